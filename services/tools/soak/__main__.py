"""`python -m services.tools.soak` / `halfmoon soak`."""

from services.tools.soak.run import main

if __name__ == "__main__":
    raise SystemExit(main())
