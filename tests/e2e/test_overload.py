"""About three times the stack's capacity: the excess is refused at once (429 with
Retry-After, before any compute), and what is accepted meets its TTFT SLO (a straggler
at most, by little).

Nothing here assumes a machine's speed: the test first measures how long one request
takes on this stack (which also lets the conductor calibrate its cost model on this
machine), then sets the arrival rate and the SLO from that. Admission is checked against
the conductor's own predictions, read back from its decision records: each request was
refused exactly when its predicted TTFT was past the SLO's margin. How many that makes
depends on the machine and the moment, so no count of refusals is asserted, only that
the overload made some and left some room."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import aiohttp
import pytest

from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack
from tests.waiting import until

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
        # The first token is the whole answer: no decode work shares the prefill's cores.
        # What this test checks is TTFT admission, and the conductor's cost model does not
        # model engines that share cores: on a CPU quota of 0.6, a decode beside the
        # prefills slowed them by a quarter in the burst, past the SLO's margin.
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
    }
    if ttft_slo_ms:
        body["ttft_slo_ms"] = ttft_slo_ms
    t0 = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        rid = resp.headers["X-Request-Id"]
        if resp.status != 200:
            return {
                "id": rid,
                "status": resp.status,
                "latency_ms": (time.perf_counter() - t0) * 1e3,
                "retry_after": resp.headers.get("Retry-After"),
                "body": await resp.json(),
            }
        ttft = None
        async for raw in resp.content:
            if ttft is None and b'"content":"' in raw and b'"content":""' not in raw:
                ttft = (time.perf_counter() - t0) * 1e3
        return {"id": rid, "status": 200, "ttft_ms": ttft}


async def decision(http, url: str, rid: str) -> dict:
    """The conductor's decision on `rid`, as it recorded it (SQL writes are batched)."""

    async def recorded() -> dict | None:
        async with http.get(f"{url}/admin/requests/{rid}") as resp:
            return (await resp.json())["decision"] if resp.status == 200 else None

    return await until(recorded, what=f"the decision on {rid}")


async def calibrated(http, url: str, prefills: int) -> float:
    """Once the conductor's cost model has learned from that many engine samples: the
    share of its SLO within which the conductor admits (its setting, as it reports it)."""

    async def learned() -> dict | None:
        async with http.get(f"{url}/admin/state") as resp:
            state = await resp.json()
        conductor = next(i for i in state["instances"] if i["role"] == "conductor")
        return conductor if conductor["cost_samples_seen"].get("prefill", 0) >= prefills else None

    conductor = await until(learned, what=f"the conductor learning from {prefills} prefills")
    return float(conductor["placement"]["slo_margin"])


async def test_excess_is_refused_fast_and_accepted_requests_meet_the_slo(auto_stack):
    rng = random.Random(4)
    async with aiohttp.ClientSession() as http:
        # One at a time: this machine's time per request (the conductor learns it too).
        alone = [(await one(http, auto_stack.url, prompt(rng)))["ttft_ms"] for _ in range(8)]
        service_ms = statistics.median(alone[2:])
        margin = await calibrated(http, auto_stack.url, prefills=8)
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
    # Arrivals three times faster than one instance serves them outgrow any queue the
    # SLO leaves room for, and the first of them find it empty.
    assert refused and accepted, "an overload must refuse some requests and admit some"
    bar_ms = margin * slo_ms  # the conductor admits predictions up to this
    async with aiohttp.ClientSession() as http:
        for r in results:  # what the conductor predicted for each, when it decided
            r["decision"] = await decision(http, auto_stack.url, r["id"])
    for r in refused:  # refused before any compute: faster than one request's prefill
        d = r["decision"]
        assert d["rejected"].startswith("predicted TTFT"), d
        assert d["predicted_ttft_ms"] > bar_ms, (bar_ms, d)
        assert r["latency_ms"] < service_ms, (service_ms, r)
        assert int(r["retry_after"]) >= 1
        assert r["body"]["error"]["code"] == "slo_unattainable"
        assert "predicted TTFT" in r["body"]["error"]["message"]
    for r in accepted:
        d = r["decision"]
        assert d["rejected"] is None and d["predicted_ttft_ms"] <= bar_ms, (bar_ms, d)
    late = max(accepted, key=lambda r: r["ttft_ms"] / r["decision"]["predicted_ttft_ms"])
    ttft_ms, predicted_ms = late["ttft_ms"], late["decision"]["predicted_ttft_ms"]
    print(
        f"accepted: TTFT / predicted up to {ttft_ms / predicted_ms:.2f} "
        f"({ttft_ms:.0f} / {predicted_ms:.0f} ms)"
    )
    # The conductor admits on predictions within its margin. Those were up to 2.2x
    # short on an AVX2 CPU while jobs waiting for the engine thread were missing from the
    # heartbeats (5 of 18 accepted missed; tests/integration/test_instance_faults.py has
    # the unit case); since, the slowest accepted request took 0.73-0.78x of the SLO in
    # runs on both kernels' paths. One straggler, by little, is allowed for a loaded
    # machine; a queue the conductor cannot see makes many, by far.
    ttfts = sorted(r["ttft_ms"] for r in accepted)
    assert sum(t > slo_ms for t in ttfts) <= 1, (slo_ms, ttfts)
    assert ttfts[-1] <= 1.1 * slo_ms, (slo_ms, ttfts)
