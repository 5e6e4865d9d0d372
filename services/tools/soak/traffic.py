"""A soak's mixed traffic: chat and completions, streamed or not, n of 1 or 2, some with
structured output, some from clients that leave mid-request; and how each one ended."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.tools.chaos.load import WORDS

# completed: a full answer | error: a clear error (an HTTP error body or an error event) |
# left: the client went away on purpose | hung: no answer by the deadline, or a stream cut
# off without a terminal event.
OUTCOMES = ("completed", "error", "left", "hung")


@dataclass(frozen=True)
class Shape:
    endpoint: str  # "chat" | "completions"
    stream: bool
    n: int
    structured: bool  # response_format json_object (chat only)
    leave_after_s: float | None  # the client goes away after this long (None: it stays)


def draw_shape(rng: random.Random, leave_share: float) -> Shape:
    endpoint = rng.choice(("chat", "completions"))
    return Shape(
        endpoint,
        stream=rng.random() < 0.5,
        n=2 if rng.random() < 0.2 else 1,
        structured=endpoint == "chat" and rng.random() < 0.15,
        leave_after_s=rng.uniform(0.2, 3.0) if rng.random() < leave_share else None,
    )


def body(shape: Shape, model: str, rng: random.Random, max_tokens: int) -> dict[str, Any]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
    if rng.random() < 1 / 3:  # a shared opening: prefix reuse
        words = "Shared opening: " + " ".join(WORDS * 3) + ". " + words
    out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "n": shape.n}
    out["stream"] = shape.stream
    if shape.endpoint == "chat":
        out["messages"] = [{"role": "user", "content": f"Write about {words}"}]
        if shape.structured:
            out["response_format"] = {"type": "json_object"}
    else:
        out["prompt"] = f"Notes on {words}:"
    return out


@dataclass
class Traffic:
    url: str
    model: str
    rate: float
    max_tokens: int
    deadline_s: float
    leave_share: float
    rng: random.Random
    outcomes: Counter = field(default_factory=Counter)
    # (unix time sent, the id of each record it has): a request of n > 1 is recorded as
    # one row per choice, "<id>-0" .. "<id>-<n-1>"
    ids: list[tuple[float, list[str]]] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def run(self, until: float, stop: asyncio.Event) -> None:
        """Poisson arrivals until `until` (monotonic) or `stop`; then every request ends."""
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < until and not stop.is_set():
                shape = draw_shape(self.rng, self.leave_share)
                task = asyncio.create_task(
                    self._one(http, shape, body(shape, self.model, self.rng, self.max_tokens))
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(self.rng.expovariate(self.rate))
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _one(self, http: aiohttp.ClientSession, shape: Shape, payload: dict) -> None:
        path = "/v1/chat/completions" if shape.endpoint == "chat" else "/v1/completions"
        sent = time.time()
        work = asyncio.create_task(self._send(http, path, payload, sent))
        limit = shape.leave_after_s if shape.leave_after_s is not None else self.deadline_s
        done, _ = await asyncio.wait({work}, timeout=limit)
        if not done:
            work.cancel()  # the client goes away (or gives up: hung)
            leaving = shape.leave_after_s is not None
            outcome = "left" if leaving else "hung"
            why = "" if leaving else f"{path} {shape}: no answer in {limit:.0f}s"
        else:
            outcome, why = work.result()
        self.outcomes[outcome] += 1
        if why and len(self.examples.setdefault(outcome, [])) < 5:
            self.examples[outcome].append(why[:300])

    async def _send(
        self, http: aiohttp.ClientSession, path: str, payload: dict, sent: float
    ) -> tuple[str, str]:
        try:
            async with http.post(f"{self.url}{path}", json=payload) as resp:
                rid = resp.headers.get("X-Request-Id", "")
                if rid:
                    n = payload["n"]
                    self.ids.append((sent, [rid] if n == 1 else [f"{rid}-{k}" for k in range(n)]))
                if resp.status != 200:
                    return "error", f"{resp.status}: {(await resp.text())[:200]}"
                if not payload["stream"]:
                    got = await resp.json()
                    return _judged(got["choices"], payload["n"])
                return await _read_stream(resp, payload["n"])
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return "hung", f"{path}: {type(exc).__name__}: {exc}"


def _judged(choices: list[dict], n: int) -> tuple[str, str]:
    finished = [c.get("finish_reason") for c in choices]
    if len(choices) != n or not all(f in ("stop", "length") for f in finished):
        return "hung", f"{len(choices)} choices of {n}, finish reasons {finished}"
    return "completed", ""


async def _read_stream(resp: aiohttp.ClientResponse, n: int) -> tuple[str, str]:
    """Server-sent events until [DONE]: completed when every choice finished."""
    finished: dict[int, str] = {}
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if len(finished) == n and all(f in ("stop", "length") for f in finished.values()):
                return "completed", ""
            return "hung", f"[DONE] with finish reasons {finished} of {n} choices"
        event = json.loads(data)
        if "error" in event:
            return "error", str(event["error"].get("message", ""))[:200]
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                finished[choice["index"]] = choice["finish_reason"]
    return "hung", "the stream ended without [DONE]"
