"""`halfmoon bench replay --compare elastic` (issue 31): three engines on a workload that
shifts phase, the P/D planner (active, from 2P+1D) against both fixed splits, in one run.

The workload is `halfmoon kv synth --shift` scaled to this machine (README.md has the
command): a prompt-heavy half, then an output-heavy one. Each engine gets a core's worth of
threads, so a role's capacity is the number of instances serving it, and neither fixed
split suits both halves. The planner decides every 2 s on a 20 s window (the defaults, 5 s
and 30 s, are sized for phases of many minutes). While a run goes on, the split is sampled
from GET /admin/state, so the report shows which split served each phase.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

import aiohttp

from services.tools.bench.replay import report
from services.tools.bench.replay.cluster import ClusterConfig
from services.tools.bench.replay.machine import split_of

_SLO_ENV = "HALFMOON_TTFT_SLO_MS={ttft} HALFMOON_TBT_SLO_MS={tbt}"
_PLANNER = (
    "--planner active HALFMOON_PLANNER_INTERVAL_S=2 HALFMOON_PLANNER_WINDOW_S=20 "
    "HALFMOON_PLANNER_COOLDOWN_S=10 HALFMOON_PLANNER_HORIZON_S=60"
)
PLANNER_RUN = "planner"


def preset(ttft_slo_ms: float, tbt_slo_ms: float) -> tuple[ClusterConfig, ...]:
    """The three clusters, every conductor judging by the bench's SLOs (the planner
    weighs splits by them; the others reject by them alike)."""
    slos = _SLO_ENV.format(ttft=ttft_slo_ms, tbt=tbt_slo_ms)
    return (
        ClusterConfig.parse(f"{PLANNER_RUN}=--prefill 2 --decode 1 {_PLANNER} {slos}"),
        ClusterConfig.parse(f"fixed_2p1d=--prefill 2 --decode 1 {slos}"),
        ClusterConfig.parse(f"fixed_1p2d=--prefill 1 --decode 2 {slos}"),
    )


async def sample_splits(url: str, every_s: float, into: list[dict[str, Any]]) -> None:
    """Until cancelled: every `every_s`, the engines' roles and who is switching."""
    start = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(f"{url}/admin/state") as resp:
                    state = await resp.json()
                prefill, decode = split_of(state)
                into.append(
                    {
                        "t_s": time.monotonic() - start,
                        "prefill": prefill,
                        "decode": decode,
                        "switching": [
                            i["instance_id"]
                            for i in state["instances"]
                            if i.get("status") == "switching"
                        ],
                    }
                )
            except (aiohttp.ClientError, KeyError, ValueError):
                pass  # a missed sample is a gap in the timeline, not a failed run
            await asyncio.sleep(every_s)


def held_by_phase(samples: Sequence[dict[str, Any]], split_s: float) -> list[str]:
    """The split ("pP+dD") seen in most samples before and after `split_s`."""
    out = []
    for part in (
        [s for s in samples if s["t_s"] < split_s],
        [s for s in samples if s["t_s"] >= split_s],
    ):
        counts: dict[str, int] = {}
        for s in part:
            label = f"{s['prefill']}P+{s['decode']}D"
            counts[label] = counts.get(label, 0) + 1
        out.append(max(counts, key=lambda k: counts[k]) if counts else "n/a")
    return out


def switches_seen(samples: Sequence[dict[str, Any]]) -> int:
    """Role changes between consecutive samples (a switch the sampler saw finish)."""
    return sum(
        (a["prefill"], a["decode"]) != (b["prefill"], b["decode"])
        for a, b in zip(samples, samples[1:])
    )


def comparison(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's lines: the planner's goodput at least the better fixed split's, and
    nothing lost or hung (every request answered: completed, or refused with a reason)."""
    by_name = {r["name"]: r["summary"] for r in runs}
    fixed = {n: s for n, s in by_name.items() if n.startswith("fixed_")}
    if PLANNER_RUN not in by_name or not fixed:
        return []
    best = max(fixed, key=lambda n: fixed[n]["goodput_rps"])
    a, b = by_name[PLANNER_RUN]["goodput_rps"], fixed[best]["goodput_rps"]
    ratio = a / b if b else None
    ok = ratio is not None and ratio >= 1.0
    out = [
        {
            "what": "goodput, planner / the better fixed split",
            "ratio": ratio,
            "target": 1.0,
            "met": ok,
            "text": f"goodput, planner / {best}: {a:.3f} / {b:.3f} req/s = "
            + (f"{ratio:.2f}x" if ratio is not None else "n/a")
            + f" (target >= 1.0x: {'met' if ok else 'NOT met'})",
        }
    ]
    for r in runs:
        s = r["summary"]
        lost = s["requests"] - s["completed"] - s["rejected"]
        out.append(
            {
                "what": f"{r['name']}: requests failed or unanswered",
                "ratio": None,
                "target": 0,
                "met": lost == 0,
                "text": f"{r['name']}: {lost} of {s['requests']} failed or unanswered "
                f"({s['rejected']} rejected with a reason) (target 0: "
                f"{'met' if lost == 0 else 'NOT met'})",
            }
        )
    return out


def describe(run: dict[str, Any], split_s: float) -> str:
    """One line per run: the splits it served each phase with, as sampled."""
    samples = run.get("splits", [])
    held = held_by_phase(samples, split_s)
    g = report.lookup(run["summary"], ("goodput_rps",))
    return (
        f"[{run['name']}] goodput {g:.3f} req/s; split held most in the first phase "
        f"{held[0]}, in the second {held[1]}; {switches_seen(samples)} role changes seen"
    )
