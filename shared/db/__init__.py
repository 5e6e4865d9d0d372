"""Request and cache metadata in SQL (SQLAlchemy 2 async; SQLite by default, PostgreSQL too)."""
