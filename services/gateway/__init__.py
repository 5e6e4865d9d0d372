"""Gateway: the OpenAI-compatible HTTP API (aiohttp), tokenization and SSE streaming."""
