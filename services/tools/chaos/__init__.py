"""`halfmoon chaos`: kill parts of a live cluster under streaming load; nothing accepted
may hang or go unrecorded.

A run starts a local cluster (`halfmoon up`'s LocalCluster, which restarts what dies) or attaches
to one, drives Poisson streaming load through the gateway, and every `--kill-every-s`
SIGKILLs one target in turn: a prefill worker, a decode worker, the conductor, the
kvmanager, the nats-server. At the end it checks that every request ended with a terminal
event (completed or a clear error) within its deadline, that every accepted request has
exactly one terminal row in SQL, and that the cluster serves again once the faults stop.
"""
