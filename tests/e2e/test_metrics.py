"""/metrics on every service of a real local stack (`halfmoon up`), scraped after real
requests and parsed as Prometheus text; values are checked against each other and against
what the API itself reported (usage), not just for presence."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 6
SYSTEM = (
    "You are a careful assistant for a library. Answer briefly and politely, cite the "
    "shelf number when you know it, and never invent a book that is not in the catalogue. "
    "The catalogue covers history, science, poetry and cooking."
)
# (messages, stream): the first request is repeated last, so its prefix is cached by then.
REQUESTS = [
    (
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any books on Rome?"}],
        False,
    ),
    ([{"role": "user", "content": "Write a haiku about the moon."}], True),
    ([{"role": "user", "content": "List three prime numbers."}], False),
    (
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any books on Rome?"}],
        True,
    ),
]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_run(n: int) -> int:
    """The first of n consecutive free ports (`halfmoon up` hands them out in order)."""
    for _ in range(100):
        base = random.randint(20000, 60000)
        if all(_bindable(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def metrics_stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("metrics-stack")
    database_url, _ = make_database("sqlite", tmp)
    base = free_port_run(4)
    s = start_stack(tmp, model_dir, database_url, ["--metrics-base-port", str(base)])
    s.metrics_base = base  # type: ignore[attr-defined]
    yield s
    rc = stop_stack(s)
    assert rc == 0, f"halfmoon up exited {rc}:\n{s.log()[-3000:]}"


def banner_urls(log: str) -> dict[str, str]:
    """Child name -> /metrics URL, as the banner lists them."""
    return {name: url for url, name in re.findall(r"(http://\S+/metrics) \((\S+)\)", log)}


async def chat(http: aiohttp.ClientSession, url: str, messages: list[dict], stream: bool) -> dict:
    """One request; returns its usage."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            return (await resp.json())["usage"]
        usage = None
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
        assert usage is not None
        return usage


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def scrape_all(http: aiohttp.ClientSession, urls: dict[str, str]) -> dict[str, dict]:
    return {name: await scrape(http, url) for name, url in urls.items()}


def settled(m: dict[str, dict], n: int) -> bool:
    """Counters that land a moment after the responses do (watchers, the KV manager)."""
    return (
        m["prefill-0"].get("halfmoon_kv_transfers_total{direction=out}") == n
        and m["kvmanager"].get("halfmoon_kvmanager_match_requests_total") == n
    )


async def test_every_service_exposes_plausible_metrics(metrics_stack):
    s = metrics_stack
    urls = banner_urls(s.log())
    base = s.metrics_base
    assert urls == {
        "gateway": f"{s.url}/metrics",
        "conductor": f"http://127.0.0.1:{base}/metrics",
        "kvmanager": f"http://127.0.0.1:{base + 1}/metrics",
        "prefill-0": f"http://127.0.0.1:{base + 2}/metrics",
        "decode-0": f"http://127.0.0.1:{base + 3}/metrics",
    }
    n = len(REQUESTS)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        usages = [await chat(http, s.url, msgs, stream) for msgs, stream in REQUESTS]
        deadline = time.monotonic() + 30
        m = await scrape_all(http, urls)
        while not settled(m, n) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            m = await scrape_all(http, urls)
    g, p, d = m["gateway"], m["prefill-0"], m["decode-0"]
    print(
        f"\nscraped: ttft mean {g['halfmoon_ttft_seconds_sum'] / n:.3f}s, itl mean "
        f"{g['halfmoon_itl_seconds_sum'] / max(g['halfmoon_itl_seconds_count'], 1):.3f}s, "
        f"e2e mean {g['halfmoon_e2e_seconds_sum'] / n:.3f}s, prefix hits "
        f"{p['halfmoon_prefix_cache_hit_tokens_total']:.0f} tokens, handoff bytes "
        f"{d['halfmoon_kv_transfer_bytes_total{direction=in}']:.0f}, fetch mean "
        f"{d['halfmoon_kv_transfer_seconds_sum{direction=in,purpose=handoff}'] / n * 1e3:.1f} ms"
    )
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0, "the repeated prompt should have hit the prefix cache"

    assert g["halfmoon_ttft_seconds_count"] == n
    assert g["halfmoon_ttft_seconds_sum"] > 0
    assert g["halfmoon_e2e_seconds_count"] == n
    assert g["halfmoon_e2e_seconds_sum"] >= g["halfmoon_ttft_seconds_sum"]
    assert g["halfmoon_itl_seconds_count"] == n * (MAX_TOKENS - 1)  # one event per token
    assert g["halfmoon_itl_seconds_sum"] > 0
    assert g["halfmoon_ttft_seconds_bucket{le=+Inf}"] == n
    assert g["halfmoon_requests_total{status=completed}"] == n
    assert g["halfmoon_requests_total{status=failed}"] == 0
    assert g["halfmoon_rejections_total{reason=slo_unattainable}"] == 0
    assert g["halfmoon_prompt_tokens_total"] == prompt_tokens
    assert g["halfmoon_generation_tokens_total"] == n * MAX_TOKENS
    assert g["halfmoon_cached_prompt_tokens_total"] == cached
    assert g["halfmoon_requests_in_flight"] == 0

    c = m["conductor"]
    assert c["halfmoon_conductor_placements_total{policy=kvcentric}"] == n
    assert c["halfmoon_conductor_placement_seconds_count{outcome=placed}"] == n
    assert c["halfmoon_conductor_decision_seconds_count"] == n
    assert (
        0
        < c["halfmoon_conductor_decision_seconds_sum"]
        <= c["halfmoon_conductor_placement_seconds_sum{outcome=placed}"]
    )
    assert c["halfmoon_conductor_live_instances{role=prefill}"] == 1
    assert c["halfmoon_conductor_live_instances{role=decode}"] == 1

    assert p[f"halfmoon_engine_info{{instance_id=prefill-0,model={MODEL},role=prefill}}"] == 1
    # The engine's own count agrees with what the API reported per request.
    assert p["halfmoon_prefix_cache_hit_tokens_total"] == cached
    assert (
        p["halfmoon_prefix_cache_hit_tokens_total"] + p["halfmoon_prefix_cache_miss_tokens_total"]
        == prompt_tokens
    )
    assert d["halfmoon_prefix_cache_hit_tokens_total"] == 0  # decode computes no prompt
    for inst in (p, d):
        assert inst["halfmoon_engine_waiting_requests"] >= 0
        assert inst["halfmoon_engine_running_requests"] >= 0
        assert inst["halfmoon_kv_blocks{state=used,tier=dram}"] >= 0
        assert inst["halfmoon_kv_blocks{state=free,tier=dram}"] > 0
        assert inst["halfmoon_kv_capacity_bytes{tier=dram}"] > 0
        assert inst["halfmoon_engine_step_seconds_count"] > 0
        assert inst["halfmoon_engine_preemptions_total"] >= 0
    assert d["halfmoon_engine_pending_imports"] >= 0
    assert p["halfmoon_kv_transfers_total{direction=out}"] == n
    assert p["halfmoon_kv_transfer_bytes_total{direction=out}"] > 0
    assert d["halfmoon_kv_transfers_total{direction=in}"] == n
    # Both ends count the same bytes for the same handoffs.
    assert (
        d["halfmoon_kv_transfer_bytes_total{direction=in}"]
        == p["halfmoon_kv_transfer_bytes_total{direction=out}"]
    )
    assert p["halfmoon_kv_transfer_seconds_count{direction=out,purpose=handoff}"] == n
    assert d["halfmoon_kv_transfer_seconds_count{direction=in,purpose=handoff}"] == n
    assert d["halfmoon_kv_transfer_seconds_sum{direction=in,purpose=handoff}"] > 0

    k = m["kvmanager"]
    assert k["halfmoon_kvmanager_index_blocks"] > 0
    assert k["halfmoon_kvmanager_blocks{instance_id=prefill-0,tier=dram}"] > 0
    assert k["halfmoon_kvmanager_match_requests_total"] == n
    assert (
        0
        < k["halfmoon_kvmanager_match_hit_blocks_total"]
        <= k["halfmoon_kvmanager_match_blocks_total"]
    )
