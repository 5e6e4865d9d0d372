"""`python -m services.sim` (same as `halfmoon sim`)."""

from services.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
