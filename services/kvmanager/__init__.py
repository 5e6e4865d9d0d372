"""kvmanager: the cluster-wide KV index, capacity accounting and eviction policies."""
