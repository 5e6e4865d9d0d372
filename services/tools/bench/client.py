"""A streaming OpenAI-compatible chat client for the benchmarks (serve, replay).

Per request: TTFT (first content chunk), the arrival time of every content chunk (for ITL
and Mooncake's TBT), completion tokens (from usage when the server sends it, else chunks),
and errors — never raised, always recorded, so a run with failures still reports.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from shared.stats import slowest_tenth_mean


@dataclass
class Result:
    ok: bool = False
    status: int = 0
    start: float = 0.0
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    end_s: float = 0.0
    error: str = ""
    request_id: str = ""  # the gateway's X-Request-Id
    # The stream ended as the API says it must: [DONE], an error event, or an error reply.
    # False after a broken connection (or while a caller's deadline cut it short).
    terminal: bool = False
    finish_reason: str = ""
    text: str = ""

    @property
    def gaps_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tbt_s(self) -> float | None:
        """Mooncake's TBT: the mean of the slowest 10% of the token gaps."""
        gaps = self.gaps_s
        return slowest_tenth_mean(gaps) if gaps else None


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    first_token: asyncio.Event | None = None,
) -> Result:
    """The request, streamed; `first_token` (if given) is set when its first token arrives."""
    res = Result(start=time.perf_counter())
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.post(f"{url.rstrip('/')}/v1/chat/completions", json=body) as resp:
            res.status = resp.status
            res.request_id = resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                res.error = (await resp.text())[:300]
                res.terminal = True
                return res
            await _read_stream(resp, res, first_token)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end_s = time.perf_counter() - res.start
    res.ok = not res.error and res.ttft_s is not None
    return res


async def _read_stream(
    resp: aiohttp.ClientResponse, res: Result, first_token: asyncio.Event | None
) -> None:
    chunks = 0
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            res.terminal = True
            break
        obj = json.loads(data)
        if "error" in obj:
            res.error = str(obj["error"])[:300]
            res.terminal = True
            return
        if obj.get("usage"):
            res.completion_tokens = obj["usage"].get("completion_tokens", 0)
            res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
            details = obj["usage"].get("prompt_tokens_details") or {}
            res.cached_tokens = details.get("cached_tokens") or 0
        for choice in obj.get("choices") or []:
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
            res.text += (choice.get("delta") or {}).get("content") or ""
            if (choice.get("delta") or {}).get("content"):
                now = time.perf_counter() - res.start
                if res.ttft_s is None:
                    res.ttft_s = now
                    if first_token is not None:
                        first_token.set()
                res.chunk_times.append(now)
                chunks += 1
    res.completion_tokens = res.completion_tokens or chunks
