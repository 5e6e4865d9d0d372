"""What prefill and decode instances share around the engine: settings, the engine
thread and the bus side (instance.py), start-up (bootstrap.py), Prometheus metrics
(metrics.py). The engine itself (shared/engine/) knows nothing of NATS or processes."""
