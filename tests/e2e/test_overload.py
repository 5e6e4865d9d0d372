"""About three times the stack's capacity: the excess is refused at once (429 with
Retry-After, before any compute), and what is accepted meets its TTFT SLO (a straggler
at most, by little).

Nothing here assumes a machine's speed: the test first measures how long one request
takes on this stack (which also lets the conductor calibrate its cost model on this
machine), then sets the arrival rate and the SLO from that."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import aiohttp
import pytest

from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def auto_stack(tmp_path, model_dir):
    url, _ = make_database("sqlite", tmp_path)
    stack = start_stack(tmp_path, model_dir, url)  # --dtype auto: whatever this CPU serves
    yield stack
    assert stop_stack(stack) == 0


def prompt(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(99_999)}" for _ in range(50))  # ~330 fresh tokens


async def one(http, url, text, ttft_slo_ms=None) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    if ttft_slo_ms:
        body["ttft_slo_ms"] = ttft_slo_ms
    t0 = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {
                "status": resp.status,
                "latency_ms": (time.perf_counter() - t0) * 1e3,
                "retry_after": resp.headers.get("Retry-After"),
                "body": await resp.json(),
            }
        ttft = None
        async for raw in resp.content:
            if ttft is None and b'"content":"' in raw and b'"content":""' not in raw:
                ttft = (time.perf_counter() - t0) * 1e3
        return {"status": 200, "ttft_ms": ttft}


async def calibrated(http, url: str, prefills: int, timeout_s: float = 30.0) -> None:
    """Wait until the conductor's cost model has learned from that many engine samples."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with http.get(f"{url}/admin/state") as resp:
            state = await resp.json()
        seen = [
            i["cost_samples_seen"].get("prefill", 0)
            for i in state["instances"]
            if i["role"] == "conductor"
        ]
        if seen and min(seen) >= prefills:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the conductor learned from {seen} samples, not {prefills}")


async def test_excess_is_refused_fast_and_accepted_requests_meet_the_slo(auto_stack):
    rng = random.Random(4)
    async with aiohttp.ClientSession() as http:
        # One at a time: this machine's time per request (the conductor learns it too).
        alone = [(await one(http, auto_stack.url, prompt(rng)))["ttft_ms"] for _ in range(8)]
        service_ms = statistics.median(alone[2:])
        await calibrated(http, auto_stack.url, prefills=8)
        slo_ms = max(8 * service_ms, 1000.0)  # room for a queue of a few requests
        gap_s = service_ms / 1e3 / 3  # three times what one prefill instance serves
        tasks = []
        for _ in range(48):
            tasks.append(asyncio.create_task(one(http, auto_stack.url, prompt(rng), slo_ms)))
            await asyncio.sleep(gap_s)
        results = await asyncio.gather(*tasks)
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(accepted) + len(refused) == len(results), results
    print(
        f"one request alone {service_ms:.0f} ms, SLO {slo_ms:.0f} ms; accepted "
        f"{len(accepted)}, refused {len(refused)}, TTFT max "
        f"{max(r['ttft_ms'] for r in accepted):.0f} ms, refusal latency max "
        f"{max((r['latency_ms'] for r in refused), default=0):.1f} ms"
    )
    assert len(refused) >= len(results) // 3, "three times capacity must refuse a good share"
    assert len(accepted) >= len(results) // 5
    for r in refused:  # refused before any compute: faster than any prefill
        assert r["latency_ms"] < min(service_ms, 250.0), r
        assert int(r["retry_after"]) >= 1
        assert r["body"]["error"]["code"] == "slo_unattainable"
        assert "predicted TTFT" in r["body"]["error"]["message"]
    # The conductor admits on predictions within 80% of the SLO. Those were up to 2.2x
    # short on an AVX2 CPU while jobs waiting for the engine thread were missing from the
    # heartbeats (5 of 18 accepted missed; tests/integration/test_instance_faults.py has
    # the unit case); since, the slowest accepted request took 0.73-0.78x of the SLO in
    # runs on both kernels' paths. One straggler, by little, is allowed for a loaded
    # machine; a queue the conductor cannot see makes many, by far.
    ttfts = sorted(r["ttft_ms"] for r in accepted)
    assert sum(t > slo_ms for t in ttfts) <= 1, (slo_ms, ttfts)
    assert ttfts[-1] <= 1.1 * slo_ms, (slo_ms, ttfts)
