"""Conductor: the global scheduler. Keeps the instance registry and places every request."""
