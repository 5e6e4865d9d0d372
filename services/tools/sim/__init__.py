"""`halfmoon sim`: a discrete-event simulator of a disaggregated cluster that drives the
live conductor's placement policies, the live KV index and the engines' block pool."""
