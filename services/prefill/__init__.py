"""Prefill service: runs prompts, emits the first token, hands the KV cache to decode."""
