"""Replay a planned workload against an OpenAI-compatible URL: open loop, by arrival time,
every response streamed; nothing raised, every outcome recorded."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import aiohttp

from services.tools.bench.client import stream_chat
from services.tools.bench.replay.metrics import ReplayedRequest, record_from
from services.tools.bench.replay.prompts import PromptPlan
from services.tools.bench.serve.workload import model_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    request_timeout_s: float = 600.0
    send_slos: bool = False  # put the SLOs on each request (the conductor may reject early)
    ttft_slo_ms: float = 0.0
    tbt_slo_ms: float = 0.0


def request_body(model: str, plan: PromptPlan, opts: RunOptions) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": plan.content}],
        "max_tokens": plan.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if opts.send_slos:
        body.update(ttft_slo_ms=opts.ttft_slo_ms, tbt_slo_ms=opts.tbt_slo_ms)
    return body


async def replay(
    url: str, plans: Sequence[PromptPlan], arrivals_s: Sequence[float], opts: RunOptions
) -> tuple[list[ReplayedRequest], float]:
    """Returns every request's record (in slice order) and the run's wall time."""
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # open loop: no client-side queueing
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        model = await model_id(http, url, "halfmoon")
        t0 = time.perf_counter()

        async def one(i: int) -> ReplayedRequest:
            await asyncio.sleep(max(0.0, t0 + arrivals_s[i] - time.perf_counter()))
            lag = time.perf_counter() - t0 - arrivals_s[i]
            res = await stream_chat(http, url, request_body(model, plans[i], opts))
            if res.error:
                log.info("request %d: %s", i, res.error[:120])
            return record_from(
                i, arrivals_s[i], lag, plans[i].input_tokens, plans[i].output_tokens, res
            )

        records = await asyncio.gather(*(one(i) for i in range(len(plans))))
        return list(records), time.perf_counter() - t0
