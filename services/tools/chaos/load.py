"""The workload (Poisson streaming chat requests) and how each one ended."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.tools.bench.client import Result, stream_chat

WORDS = (
    "moon tide harbor lantern river stone garden winter signal orbit copper meadow "
    "engine archive bridge falcon canyon ember glacier harvest island jungle"
).split()
OUTCOMES = ("completed", "error", "hung", "inconsistent")


def make_body(
    model: str, rng: random.Random, max_tokens: int, long_share: float = 0.0, long_words: int = 0
) -> dict[str, Any]:
    """A short prompt; one in three shares a long opening, so prefix reuse (and prefix
    pulls between prefill instances) is exercised too. A `long_share` of them are
    `long_words` long instead: more than one prefill chunk, so their KV streams to decode
    while prefill runs, and a kill can land mid-stream."""
    n = long_words if rng.random() < long_share else rng.randint(8, 40)
    words = " ".join(rng.choice(WORDS) for _ in range(n))
    if rng.random() < 1 / 3:
        words = "Shared opening: " + " ".join(WORDS * 3) + ". " + words
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Write about {words}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def outcome(res: Result, max_tokens: int) -> str:
    """completed | error (a clear one: an error reply or event) | hung (no terminal event
    in time, or a stream cut off without one) | inconsistent (finished with the wrong
    number of tokens: a duplicate or a gap in the stream)."""
    if not res.terminal:
        return "hung"
    if res.error:
        return "error"
    if res.finish_reason not in ("stop", "length"):
        return "hung"  # [DONE] without a finish: the stream ended without saying why
    if res.completion_tokens != max_tokens or len(res.chunk_times) > max_tokens:
        return "inconsistent"
    return "completed"


@dataclass
class Load:
    url: str
    model: str
    rate: float
    max_tokens: int
    deadline_s: float
    rng: random.Random
    long_share: float = 0.0
    long_words: int = 0
    results: list[Result] = field(default_factory=list)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def run(self, until: float, stop: asyncio.Event) -> None:
        """Send until `until` (monotonic) or `stop`, then wait for every request to end."""
        while time.monotonic() < until and not stop.is_set():
            body = make_body(
                self.model, self.rng, self.max_tokens, self.long_share, self.long_words
            )
            task = asyncio.create_task(self._one(body))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self.rng.expovariate(self.rate))
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _one(self, body: dict[str, Any]) -> None:
        # The deadline cuts the stream inside stream_chat, so its Result keeps the id.
        timeout = aiohttp.ClientTimeout(total=self.deadline_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            self.results.append(await stream_chat(http, self.url, body))

    def tally(self) -> Counter:
        return Counter(outcome(r, self.max_tokens) for r in self.results)

    def examples(self, kind: str, n: int = 5) -> list[str]:
        return [
            f"{r.request_id or '?'}: {r.error or r.finish_reason or 'no terminal event'}"
            for r in self.results
            if outcome(r, self.max_tokens) == kind
        ][:n]
