"""`halfmoon sim`: a discrete-event simulator of a disaggregated cluster that drives the
live conductor's placement policies and the live KV index and eviction code."""
