"""Benchmarks (`halfmoon bench ...`): each prints its figures against a baseline from the
same run."""
