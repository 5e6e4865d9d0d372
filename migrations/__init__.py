"""Alembic migrations (run by `halfmoon db upgrade` and on `halfmoon up`)."""
