"""Code shared by every Halfmoon process: settings, subjects, messages, hashing, bus, db, engine."""
