"""Decode service: receives prefilled KV, generates the remaining tokens, streams them."""
