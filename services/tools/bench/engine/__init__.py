"""`halfmoon bench engine`: the engine at each precision against transformers and against
this machine's limits, measured in one run (see cli.py)."""
