"""`halfmoon soak`: the run (cluster, traffic, faults, sampling) and its report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from services.tools.bench.placement import free_port
from services.tools.chaos.args import ChaosSettings
from services.tools.chaos.audit import audit
from services.tools.chaos.faults import Faults, cluster_victims
from services.tools.chaos.run import conclude, model_name, start_cluster, tool_main
from services.tools.soak.args import SoakSettings, parse_args
from services.tools.soak.growth import Growth, judge, runtime_bounded, table
from services.tools.soak.sample import (
    Samples,
    cluster_processes,
    sample_go,
    sample_jetstream,
    sample_sql,
)
from services.tools.soak.traffic import Traffic
from services.up import LocalCluster
from shared import aio, bus
from shared.db.session import make_engine
from shared.lifecycle import install_stop_signals
from shared.settings import BaseSettings

log = logging.getLogger("halfmoon.soak")


def cluster_env(s: SoakSettings) -> dict[str, str]:
    """Short retention for the started cluster, so its bounds are reached within the run;
    and SLOs that admit all it has room for: a soak measures growth under load, and
    admission on a loaded machine would only lower the load."""
    r = str(s.retention)
    return {
        "HALFMOON_REQUEST_RETENTION_S": r,
        "HALFMOON_LOAD_RETENTION_S": r,
        "HALFMOON_STREAM_MAX_AGE_S": r,
        "HALFMOON_TTFT_SLO_MS": "3600000",
        "HALFMOON_TBT_SLO_MS": "60000",
    }


async def sample_until(
    cluster: LocalCluster,
    samples: Samples,
    nats_url: str,
    t0: float,
    done: asyncio.Event,
    every_s: float,
) -> None:
    engine = make_engine(cluster.database_url)
    nc = await bus.connect(BaseSettings(nats_url=nats_url), "soak")
    prof = cluster.nats.prof_port if cluster.nats is not None else 0
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
    try:
        while not done.is_set():
            t = time.monotonic() - t0
            for name, pid in cluster_processes(cluster):
                series = samples.process(name, pid, t)
                if series and name == "nats-server" and prof > 0:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError):
                        await sample_go(http, f"http://127.0.0.1:{prof}", series, samples, t)
            with contextlib.suppress(Exception):  # SQL busy, NATS killed: skip this sample
                await sample_sql(engine, samples, t)
            with contextlib.suppress(Exception):
                await sample_jetstream(nc, samples, t)
            await aio.wait_set(done, every_s)
    finally:
        await http.close()
        await bus.close(nc)
        await engine.dispose()


async def soak(s: SoakSettings, cluster: LocalCluster, stop: asyncio.Event) -> dict[str, Any]:
    url = f"http://{cluster.s.host}:{cluster.s.port}"
    rng = random.Random(s.seed)
    traffic = Traffic(
        url, await model_name(url), s.rate, s.max_tokens, s.request_deadline_s, s.leave_share, rng
    )
    faults = Faults(s.target_list(), random.Random(s.seed + 1), cluster_victims(cluster))
    samples = Samples(s.warmup_s)
    t0 = time.monotonic()
    until = t0 + s.duration_s
    done = asyncio.Event()
    sampler = asyncio.create_task(
        sample_until(cluster, samples, cluster.nats_url, t0, done, s.sample_s)
    )
    work = [traffic.run(until, stop)]
    if s.kill_every_s > 0 and s.target_list():
        work.append(faults.run(t0, until, s.kill_every_s, stop))
    try:
        await asyncio.gather(*work)
    finally:
        done.set()
        await sampler
    end = time.monotonic() - t0
    # Rows of requests sent in the last part of the run (older ones may be pruned already).
    since = time.time() - end + max(0.0, end - s.retention / 2)
    ids = {rid for sent, rids in traffic.ids if sent >= since for rid in rids}
    records = await audit(cluster.database_url, since, ids)
    lost = records.missing[:5] + records.not_terminal[:5]
    growths = judge_all(samples.points, s.duration_s, end)
    r = report(s, traffic, faults, records.lost, lost, growths, end)
    # Every sample, so that a run's verdict can be checked or judged again from its report.
    r["samples"] = {f"{series} | {kind}": pts for (series, kind), pts in samples.points.items()}
    return r


def judge_all(
    points: dict[tuple[str, str], list[tuple[float, float]]], duration_s: float, end: float
) -> list[Growth]:
    """Every series judged over the second half of the traffic (the run's `end` s)."""
    half = min(end, duration_s) / 2
    return runtime_bounded(
        [judge(series, kind, pts, half, end) for (series, kind), pts in sorted(points.items())]
    )


def rejudge(r: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """A saved report judged again from its own samples with this version's rules (what it
    measured is kept; only the growth verdicts and the table are new)."""
    points = {
        tuple(key.split(" | ", 1)): [(float(t), float(v)) for t, v in pts]
        for key, pts in r["samples"].items()
    }
    growths = judge_all(points, duration_s, float(r["wall_s"]))
    return {**r, **verdicts(growths)}


def verdicts(growths: list[Growth]) -> dict[str, Any]:
    """The report's growth part: each series' figures and verdict, and the table."""
    return {
        "growth": [dict(asdict(g), ok=g.ok, judged=g.judged) for g in growths],
        "table": table(growths),
    }


def report(
    s: SoakSettings,
    traffic: Traffic,
    faults: Faults,
    lost: int,
    lost_ids: list[str],
    growths: list[Growth],
    wall_s: float,
) -> dict[str, Any]:
    return {
        "settings": s.model_dump(),
        "wall_s": round(wall_s, 1),
        "retention_s": s.retention,
        "outcomes": dict(traffic.outcomes),
        "examples": traffic.examples,
        "records_lost": lost,
        "records_lost_ids": lost_ids,
        "kills": [asdict(k) for k in faults.kills],
        **verdicts(growths),
    }


def failed(r: dict[str, Any]) -> bool:
    return bool(
        r["outcomes"].get("hung", 0)
        or r["records_lost"]
        or not any(g["judged"] for g in r["growth"])
        or not all(g["ok"] for g in r["growth"])
    )


def summary(r: dict[str, Any]) -> str:
    o = r["outcomes"]
    kills = ", ".join(f"{k['target']}@{k['at_s']:.0f}s" for k in r["kills"]) or "none"
    lines = [
        f"soak: {sum(o.values())} requests in {r['wall_s'] / 60:.1f} min; kills: {kills}; "
        f"retention {r['retention_s']:.0f}s",
        f"  completed {o.get('completed', 0)}, clear errors {o.get('error', 0)}, "
        f"clients that left {o.get('left', 0)}, hung {o.get('hung', 0)}, "
        f"records lost {r['records_lost']}",
        *(f"  {kind}: {e}" for kind, es in r["examples"].items() for e in es),
        *(f"  no terminal record: {rid}" for rid in r["records_lost_ids"]),
        "growth over the second half (least squares through each slice's lowest sample):",
        r["table"],
        "soak: FAILED" if failed(r) else "soak: passed",
    ]
    return "\n".join(lines)


async def run(s: SoakSettings) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    os.environ.update(cluster_env(s))
    chaos = ChaosSettings(
        prefill=s.prefill, decode=s.decode, model=s.model, dtype=s.dtype, log_level=s.log_level
    )
    # The nats-server's profiling endpoint: its Go runtime's own memory accounting.
    cluster = await start_cluster(chaos, stop, nats_prof_port=free_port())
    halt = asyncio.Event()
    supervisor = asyncio.create_task(cluster.watch(halt))  # restarts what is killed
    try:
        r = await soak(s, cluster, stop)
    finally:
        halt.set()
        await asyncio.gather(supervisor, return_exceptions=True)
        await cluster.stop()
    return conclude(summary(r), r, s.report, failed(r), cluster)


def judge_saved(s: SoakSettings) -> int:
    saved = json.loads(Path(s.judge).read_text())
    r = rejudge(saved, float(saved["settings"]["minutes"]) * 60.0)
    return conclude(summary(r), r, s.report, failed(r), None)


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    if s.judge:
        return judge_saved(s)
    return tool_main("soak", lambda: run(s))
