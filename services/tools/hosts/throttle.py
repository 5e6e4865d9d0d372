"""The throttle: host d's link shaped to `mbit` Mbit/s mid-run, and whether the leading
conductor's handoff predictions follow it.

Requests go one at a time (so each handoff has the link to itself), each a fresh prompt of
one prefill chunk or less (so its whole KV moves after the first token: nothing streams
ahead). Before each, the prediction is read off the leader's last heartbeat (its cost
model, as it would place with); after it, the measured handoff comes from the request's SQL
row (the gateway's clock: decode's first token less prefill's), and the next request waits
until the leader has learned from this one. The first `calibrate` requests are the
calibration; the rest are scored: |predicted / measured - 1|.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import nats
from nats.aio.msg import Msg
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.conductor.costmodel import CostModel
from services.tools.chaos.load import WORDS
from services.tools.hosts.cluster import HostCluster
from shared import subjects
from shared.db.schema import RequestRecord
from shared.db.session import make_engine, sessionmaker
from shared.messages import InstanceInfo

TARGET = 0.25  # the scored predictions' median error must be within this


@dataclass
class ThrottleReport:
    mbit: float
    calibrate: int
    rows: list[dict[str, float]] = field(default_factory=list)

    def scored(self) -> list[float]:
        return [abs(r["predicted_s"] / r["measured_s"] - 1) for r in self.rows[self.calibrate :]]

    def summary(self) -> dict[str, Any]:
        errors = self.scored()
        median = statistics.median(errors) if errors else math.inf
        return {
            "scored": len(errors),
            "median_error": round(median, 3),
            "max_error": round(max(errors), 3) if errors else None,
            "target": TARGET,
            "met": median <= TARGET,
        }


class LeaderWatch:
    """The leading conductor's latest heartbeat."""

    def __init__(self) -> None:
        self.info: InstanceInfo | None = None

    async def on_beat(self, msg: Msg) -> None:
        info = InstanceInfo.model_validate_json(msg.data)
        if info.leader:
            self.info = info

    def handoffs(self) -> int:
        return self.info.cost_samples_seen.get("handoff", 0) if self.info else 0

    def model(self) -> CostModel:
        assert self.info is not None
        return CostModel.from_params(self.info.cost_params, self.info.cost_model)

    async def learned_more_than(self, seen: int, timeout_s: float = 60.0) -> None:
        """Until a leader's heartbeat says it learned from more than `seen` handoffs."""
        async with asyncio.timeout(timeout_s):
            while self.info is None or self.handoffs() <= seen:
                await asyncio.sleep(0.2)


async def chat(url: str, model: str, words: int, rng: random.Random) -> str:
    prompt = "Summarize: " + " ".join(rng.choice(WORDS) for _ in range(words))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"throttle request failed: {data}")
            return str(resp.headers["X-Request-Id"])


async def measured(engine: AsyncEngine, request_id: str, block_size: int) -> tuple[float, int]:
    """(seconds from prefill's first token to decode's, KV blocks decode fetched)."""
    t = RequestRecord
    async with sessionmaker(engine)() as s:
        deadline = time.monotonic() + 30
        while True:
            row = (await s.execute(select(t).where(t.id == request_id))).scalar_one_or_none()
            if row is not None and row.decode_first_token_time and row.ttft_ms:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no finished row for {request_id}")
            await asyncio.sleep(0.3)
            s.expire_all()
    seconds = row.decode_first_token_time - row.arrival_time - row.ttft_ms / 1e3
    held = (row.handoff_held_tokens or 0) // block_size
    return seconds, -(-row.prompt_tokens // block_size) - held


async def throttle_run(
    c: HostCluster, model: str, mbit: float, requests: int, calibrate: int
) -> ThrottleReport:
    watch = LeaderWatch()
    nc = await nats.connect(c.t.nats_urls())
    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=watch.on_beat)
    report = ThrottleReport(mbit, calibrate)
    rng = random.Random(7)
    host = c.t.host("d")
    engine = make_engine(c.database_url)  # one for the run: each request reads one row
    try:
        await watch.learned_more_than(-1)  # a leader's heartbeat, with its model
        c.net.throttle(host, mbit)
        for i in range(requests):
            seen, cost = watch.handoffs(), watch.model()
            rid = await chat(c.t.gateway_urls()[i % 2], model, rng.randint(150, 300), rng)
            seconds, blocks = await measured(engine, rid, cost.block_size)
            predicted = cost.handoff_time_s(blocks)
            report.rows.append({"blocks": blocks, "predicted_s": predicted, "measured_s": seconds})
            await watch.learned_more_than(seen)
    finally:
        c.net.unthrottle(host)
        await nc.close()
        await engine.dispose()
    return report
