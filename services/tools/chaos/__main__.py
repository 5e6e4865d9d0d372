"""`python -m services.tools.chaos` / `halfmoon chaos`."""

from services.tools.chaos.run import main

if __name__ == "__main__":
    raise SystemExit(main())
