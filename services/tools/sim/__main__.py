"""`python -m services.tools.sim` (same as `halfmoon sim`)."""

from services.tools.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
