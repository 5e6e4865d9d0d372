"""Halfmoon's processes: one package per service, each runnable as `python -m services.<name>`."""
