"""`halfmoon bench conductor`: how fast the conductor decides, and how right it is.

- decision latency: live lists + snapshot + kvcentric decision for 8, 64, 256 and 1,024
  prefill instances (and half as many decode instances) with 100-block prompts and random
  cached prefixes (pure code, no bus). Between decisions, untimed, what the live conductor
  does meanwhile: the dispatch accounting of the decision, and heartbeats from 1% of the
  instances (a 1 s heartbeat at 100 decisions a second), each of which drops what the
  registry kept for that instance. Targets (issue #19): p99 at most 0.2 ms at 64
  instances, 1 ms at 1,024.
- with --url: a live run against a stack (two prefill instances, say): requests with
  shared and fresh prefixes at a steady rate (by default 70% of what the prefill
  instances serve, measured first with requests sent one at a time); predicted TTFT
  (the conductor's decision record) against measured TTFT (the gateway's request
  record), median absolute error,
  over the requests after the first --calibration-requests (the conductor calibrates its
  cost model online from what the engines report: on a machine without a profiled fit it
  starts from the built-in defaults). It says which prior the conductor started from.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any, Sequence

import aiohttp

from services.conductor import snapshot
from services.conductor.costmodel import CostModel
from services.conductor.policy import make_policy
from services.conductor.registry import Registry
from shared.messages import GenerateRequest, InstanceInfo, Role, SamplingParams
from shared.stats import percentile


def prefill_info(rng: random.Random, i: int) -> InstanceInfo:
    return InstanceInfo(
        instance_id=f"prefill-{i}",
        role=Role.PREFILL,
        queue_prompts=[rng.randrange(64, 2048) for _ in range(rng.randrange(4))],
    )


def decision_latency(instances: int, blocks: int, runs: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    reg = Registry(expiry_s=3)
    for i in range(instances):
        reg.seen(prefill_info(rng, i), 0)
    for i in range(max(1, instances // 2)):
        reg.seen(
            InstanceInfo(
                instance_id=f"decode-{i}",
                role=Role.DECODE,
                running=rng.randrange(64),
                mean_context=rng.randrange(100, 2000),
            ),
            0,
        )
    cost, policy = CostModel(), make_policy("kvcentric")
    req = GenerateRequest(
        request_id="r",
        model="m",
        prompt_token_ids=[1] * blocks * 16,
        sampling=SamplingParams(),
        arrival_time=0,
    )
    times = []
    beats = max(1, instances // 100)
    for _ in range(runs):
        matches = {
            f"prefill-{i}": rng.randrange(blocks + 1)
            for i in rng.sample(range(instances), k=min(instances, 8))
        }
        t0 = time.perf_counter()
        snap = snapshot.build(reg.alive(Role.PREFILL, 0), reg.alive(Role.DECODE, 0), cost, 1.5)
        d = policy.decide(snap, snapshot.request_view(req, matches, 30.0, 0.3))
        times.append(time.perf_counter() - t0)
        if d.prefill is not None:  # handlers.Conductor._account
            reg.dispatched(d.prefill.instance_id, d.prefill.prefill_s)
            reg.dispatched(d.decode_id, tokens=len(req.prompt_token_ids), blocks=d.decode_blocks)
        for i in rng.sample(range(instances), k=beats):
            reg.seen(prefill_info(rng, i), 0)
    return {"p50_ms": percentile(times, 50) * 1e3, "p99_ms": percentile(times, 99) * 1e3}


async def _one(http: aiohttp.ClientSession, url: str, model: str, prompt: str) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        return {"status": resp.status, "id": resp.headers.get("X-Request-Id", "")}


async def _capacity(
    http: aiohttp.ClientSession, url: str, model: str, docs: list[str], rng: random.Random
) -> tuple[float, int]:
    """(seconds per request alone, prefill instances): one fresh prompt of each document
    length in turn, timed end to end, so the live run's rate follows this machine's speed
    (a rate fixed for one CPU is an overload on a slower one, and then the error measured
    is that of a long queue, not of the cost model)."""
    times = []
    for doc in docs:
        t0 = time.perf_counter()
        await _one(http, url, model, f"{rng.random()} {doc}")
        times.append(time.perf_counter() - t0)
    async with http.get(f"{url}/admin/state") as resp:
        state = await resp.json()
    prefills = sum(i["role"] == "prefill" for i in state["instances"])
    return statistics.mean(times), max(1, prefills)


async def live(
    url: str, database_url: str, requests: int, rate: float, calibration: int, load: float
) -> dict[str, Any]:
    rng = random.Random(9)
    docs = [
        " ".join(f"w{rng.randrange(10_000)}" for _ in range(rng.choice((40, 120, 200))))
        for _ in range(4)
    ]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        prior = await _cost_model(http, url)
        alone_s, prefills = await _capacity(http, url, model, docs, rng)
        # Half the requests reuse a document, so they cost less than alone_s: `load` of
        # the fresh-prompt capacity is a little less in fact.
        rate = rate or load * prefills / alone_s
        tasks = []
        for i in range(requests):  # half reuse a document (prefix hits), half are fresh
            prompt = (docs[i % 4] if i % 2 else f"{rng.random()} " + docs[i % 4][::-1]) + f" Q{i}?"
            tasks.append(asyncio.create_task(_one(http, url, model, prompt)))
            await asyncio.sleep(1 / rate)
        results = await asyncio.gather(*tasks)
        after = await _cost_model(http, url)
    pairs = await _records(database_url, [r["id"] for r in results])
    first, rest = pairs[:calibration], pairs[calibration:]
    return {
        "requests": requests,
        "rate_per_s": rate,
        "alone_s": alone_s,
        "prefill_instances": prefills,
        "compared": len(pairs),
        "prior": prior,
        "cost_model_after": after,
        "calibration_requests": calibration,
        "during_calibration": _errors(first),
        "after_calibration": _errors(rest),
    }


async def _cost_model(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/admin/state") as resp:
        state = await resp.json()
    return next(
        (
            i.get("cost_model", "")
            for i in state["instances"]
            if i["role"] == "conductor" and i.get("leader", True)
        ),
        "",
    )


async def _records(
    database_url: str, ids: list[str], timeout_s: float = 30.0
) -> list[tuple[float, float]]:
    """(predicted, measured) TTFT per request, in order, once their records are written."""
    from shared.db.schema import DecisionRecord, RequestRecord
    from shared.db.session import make_engine, sessionmaker

    engine = make_engine(database_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            pairs: list[tuple[float, float]] = []
            async with sessionmaker(engine)() as s:
                for rid in ids:
                    rec, dec = await s.get(RequestRecord, rid), await s.get(DecisionRecord, rid)
                    if rec and dec and rec.ttft_ms and dec.predicted_ttft_ms:
                        pairs.append((dec.predicted_ttft_ms, rec.ttft_ms))
            if len(pairs) == len(ids) or time.monotonic() > deadline:
                return pairs  # records are written in batches: wait for all of them
            await asyncio.sleep(0.5)
    finally:
        await engine.dispose()


def _errors(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    errs = [abs(p - m) / m for p, m in pairs]
    return {
        "requests": len(pairs),
        "median_abs_error": statistics.median(errs) if errs else float("nan"),
        "p90_abs_error": percentile(errs, 90) if errs else float("nan"),
        "median_predicted_ms": statistics.median(p for p, _ in pairs) if pairs else None,
        "median_measured_ms": statistics.median(m for _, m in pairs) if pairs else None,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench conductor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=2000)
    p.add_argument("--url", default="", help="a running gateway, for the live accuracy run")
    p.add_argument("--database-url", default="", help="that stack's database")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument(
        "--calibration-requests",
        type=int,
        default=50,
        help="requests the error is not counted over (the conductor learns)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="requests per second in the live run (0: --load of the measured capacity)",
    )
    p.add_argument(
        "--load",
        type=float,
        default=0.7,
        help="with --rate 0: the share of the prefill instances' capacity to send, measured "
        "first from requests sent one at a time",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out: dict[str, Any] = {
        "decision_latency": {
            str(n): decision_latency(n, 100, args.runs, seed=n) for n in (8, 64, 256, 1024)
        }
    }
    if args.url:
        out["live"] = asyncio.run(
            live(
                args.url,
                args.database_url,
                args.requests,
                args.rate,
                args.calibration_requests,
                args.load,
            )
        )
    print(json.dumps(out, indent=2))
    print_summary(out)
    return 0


def print_summary(out: dict[str, Any]) -> None:
    """The figures in a line each: decision latency per cluster size, then the live run."""
    for n, r in out["decision_latency"].items():
        print(
            f"decision, {n:>4} prefill instances, 100-block prompt: p50 {r['p50_ms']:.3f} ms, "
            f"p99 {r['p99_ms']:.3f} ms"
        )
    if "live" in out:
        lv = out["live"]
        print(
            f"live: prior {lv['prior']!r}; one request alone {lv['alone_s'] * 1e3:.0f} ms on "
            f"{lv['prefill_instances']} prefill instances, {lv['rate_per_s']:.2f} requests/s"
        )
        for name in ("during_calibration", "after_calibration"):
            e = lv[name]
            print(
                f"live, {name.replace('_', ' ')} ({e['requests']} requests): predicted vs "
                f"measured TTFT median abs error {e['median_abs_error'] * 100:.1f}% "
                f"(p90 {e['p90_abs_error'] * 100:.1f}%), medians {e['median_predicted_ms']} / "
                f"{e['median_measured_ms']} ms"
            )


if __name__ == "__main__":
    raise SystemExit(main())
