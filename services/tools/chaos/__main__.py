"""`python -m services.chaos` / `halfmoon chaos`."""

from services.chaos.run import main

if __name__ == "__main__":
    raise SystemExit(main())
