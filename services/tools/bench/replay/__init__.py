"""`halfmoon bench replay`: a Mooncake trace against the live stack (see cli.py)."""
