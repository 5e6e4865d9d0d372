"""`halfmoon chaos`: the run (cluster, load, faults, recovery, audit) and its report."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence, cast

import aiohttp

from services.tools.bench.client import stream_chat
from services.tools.bench.placement import free_port
from services.tools.chaos.args import ChaosSettings, parse_args
from services.tools.chaos.audit import Audit, audit
from services.tools.chaos.faults import Faults, HeartbeatVictims, cluster_victims
from services.tools.chaos.load import Load, make_body
from services.tools.chaos.switches import Switcher
from services.up import LocalCluster, UpSettings
from shared import bus, subjects
from shared.db import session as db
from shared.lifecycle import install_stop_signals, setup_logging
from shared.model_store import ensure_model
from shared.natsd import EmbeddedNats
from shared.settings import BaseSettings

log = logging.getLogger("halfmoon.chaos")
SERVING_ROLES = {"gateway", "conductor", "kvmanager", "prefill", "decode"}


async def start_cluster(
    s: ChaosSettings, stop: asyncio.Event, nats_prof_port: int = 0
) -> LocalCluster:
    """A fresh local cluster in a temporary HALFMOON_HOME (its own NATS, SQLite, ports);
    `nats_prof_port` > 0 opens the nats-server's Go profiling endpoint there."""
    model_dir = await asyncio.to_thread(ensure_model, s.model)  # before HALFMOON_HOME moves
    home = Path(tempfile.mkdtemp(prefix="halfmoon-chaos-"))
    os.environ["HALFMOON_HOME"] = str(home)
    # The gateway's fault handling, tightened so a lost stream is placed again quickly.
    os.environ["HALFMOON_TOKEN_TIMEOUT_S"] = str(s.token_timeout_s)
    os.environ["HALFMOON_FIRST_TOKEN_TIMEOUT_S"] = str(max(60.0, 3 * s.token_timeout_s))
    if s.chunk_tokens:  # smaller chunks: more prompts stream, and for longer
        os.environ["HALFMOON_CHUNK_TOKENS"] = str(s.chunk_tokens)
    up = UpSettings(
        port=free_port(),
        console=False,
        prefill=s.prefill,
        decode=s.decode,
        model=str(model_dir),
        dtype=cast(Any, s.dtype),  # a str here; UpSettings validates it against its choices
        log_level=s.log_level,
        database_url=f"sqlite+aiosqlite:///{db.sqlite_file(home)}",
        restart=True,
        restart_backoff_s=0.5,
        metrics_base_port=0,
    )
    cluster = LocalCluster(up)
    cluster.nats = EmbeddedNats(home / "nats", prof_port=nats_prof_port)
    cluster.nats_url = await asyncio.to_thread(cluster.nats.start)
    await db.upgrade_async(cluster.database_url)
    log.info("chaos: starting a cluster in %s (%d prefill, %d decode)", home, s.prefill, s.decode)
    await cluster.start(model_dir)
    if not await cluster.wait_ready(stop):
        await cluster.stop()
        raise RuntimeError("the cluster did not become ready")
    return cluster


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models") as resp:
            return (await resp.json())["data"][0]["id"]


async def recover(url: str, model: str, beats: HeartbeatVictims, s: ChaosSettings) -> dict:
    """Once the faults stop: every role heard from again, then requests complete again."""
    t0 = time.monotonic()
    deadline = t0 + s.recovery_s
    while not SERVING_ROLES <= beats.roles() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    roles_s = time.monotonic() - t0
    rng, ok, last = random.Random(s.seed + 1), 0, ""
    while ok < 2 and time.monotonic() < deadline:
        timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
        async with aiohttp.ClientSession(timeout=timeout) as http:
            res = await stream_chat(http, url, make_body(model, rng, 8))
        if res.terminal and not res.error:
            ok += 1
        else:
            last = res.error or "no terminal event"
            await asyncio.sleep(1.0)
    return {
        "recovered": ok == 2,
        "roles_back_s": round(roles_s, 1),
        "serving_again_s": round(time.monotonic() - t0, 1),
        "last_error": last[:200],
    }


async def chaos(
    s: ChaosSettings, url: str, nats_url: str, victims: Any, database_url: str, stop: asyncio.Event
) -> dict:
    model = await model_name(url)
    beats = HeartbeatVictims()
    nc = await bus.connect(BaseSettings(nats_url=nats_url), "chaos")
    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=beats.on_beat)
    rng = random.Random(s.seed)
    load = Load(
        url,
        model,
        s.rate,
        s.max_tokens,
        s.request_deadline_s,
        random.Random(s.seed),
        s.long_share,
        s.long_words,
    )
    faults = Faults(s.target_list(), rng, victims or beats)
    faults.begin_switch = Switcher(nc, beats, random.Random(s.seed + 1), database_url).begin
    since = time.time()
    t0 = time.monotonic()
    until = t0 + s.duration_s
    try:
        log.warning(
            "chaos: %.0fs of load at %.1f req/s, a kill every ~%.0fs (%s)",
            s.duration_s,
            s.rate,
            s.kill_every_s,
            s.targets,
        )
        await asyncio.gather(load.run(until, stop), faults.run(t0, until, s.kill_every_s, stop))
        recovery = await recover(url, model, beats, s)
    finally:
        await bus.close(nc)
    ids = {r.request_id for r in load.results if r.request_id}
    records = await audit(database_url, since, ids)
    return _report(s, load, faults, recovery, records, time.monotonic() - t0)


def _report(
    s: ChaosSettings, load: Load, faults: Faults, recovery: dict, records: Audit, wall_s: float
) -> dict:
    tally = load.tally()
    return {
        "settings": s.model_dump(),
        "wall_s": round(wall_s, 1),
        "sent": len(load.results),
        "completed": tally["completed"],
        "error": tally["error"],
        "hung": tally["hung"],
        "inconsistent": tally["inconsistent"],
        "records_lost": records.lost,
        "pipelined": records.pipelined,
        "records": {
            "rows": records.rows,
            "by_status": dict(records.by_status),
            "not_terminal": records.not_terminal[:10],
            "missing": records.missing[:10],
            "switches_draining": records.switches_draining[:10],
        },
        "errors": load.examples("error"),
        "hung_examples": load.examples("hung"),
        "kills": [asdict(k) for k in faults.kills],
        "skipped": faults.skipped,
        "recovery": recovery,
    }


def failed(report: dict) -> bool:
    return bool(
        report["hung"]
        or report["inconsistent"]
        or report["records_lost"]
        or report["records"]["switches_draining"]
        or not report["recovery"]["recovered"]
    )


def summary(report: dict) -> str:
    kills = ", ".join(f"{k['target']}@{k['at_s']:.0f}s" for k in report["kills"]) or "none"
    r = report["recovery"]
    lines = [
        f"chaos: {report['sent']} requests sent in {report['settings']['duration_s']:.0f}s; "
        f"kills: {kills}",
        f"  completed          {report['completed']}",
        f"  clear error        {report['error']}",
        f"  hung               {report['hung']}",
        f"  inconsistent       {report['inconsistent']}",
        f"  records lost       {report['records_lost']}  (SQL rows {report['records']['rows']}: "
        f"{report['records']['by_status']})",
        f"  pipelined prefill  {report.get('pipelined', 0)} requests placed on a group",
        f"  switches draining  {len(report['records']['switches_draining'])}  "
        "(role switches that never ended)",
        f"  recovered          {'yes' if r['recovered'] else 'NO'} (all roles back after "
        f"{r['roles_back_s']}s, serving after {r['serving_again_s']}s)",
    ]
    for title, key in (("errors", "errors"), ("hung", "hung_examples")):
        lines += [f"  {title}: {e}" for e in report[key]]
    lines.append("chaos: FAILED" if failed(report) else "chaos: passed")
    return "\n".join(lines)


async def run(s: ChaosSettings) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    cluster: LocalCluster | None = None
    if not s.url:
        cluster = await start_cluster(s, stop)
    halt = asyncio.Event()  # the supervisor runs until the report is done, not until Ctrl-C
    supervisor = asyncio.create_task(cluster.watch(halt)) if cluster else None
    try:
        if cluster is not None:
            url = f"http://{cluster.s.host}:{cluster.s.port}"
            report = await chaos(
                s, url, cluster.nats_url, cluster_victims(cluster), cluster.database_url, stop
            )
        else:
            report = await chaos(
                s,
                s.url.rstrip("/"),
                s.nats_url or BaseSettings().nats_url,
                None,
                s.database_url,
                stop,
            )
    finally:
        halt.set()
        if cluster is not None:
            await asyncio.gather(supervisor, return_exceptions=True)  # type: ignore[arg-type]
            await cluster.stop()
    return conclude(summary(report), report, s.report, failed(report), cluster)


def conclude(
    text: str, report: dict[str, Any], path: str, bad: bool, cluster: LocalCluster | None
) -> int:
    """Print the run's summary, write its report, and keep the cluster's folder (logs,
    database) only when the run failed: 1 then, else 0."""
    print(text, flush=True)
    if path:
        Path(path).write_text(json.dumps(report, indent=2))
    if cluster is not None and not bad:
        shutil.rmtree(cluster.home, ignore_errors=True)
    return 1 if bad else 0


def tool_main(name: str, run: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """A cluster tool's process (chaos, soak): its logging, its exit codes (130 on
    Ctrl-C, 2 when the cluster cannot start)."""
    setup_logging("INFO", name)
    logging.getLogger("nats").setLevel(logging.CRITICAL)  # reconnect noise while NATS is down
    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        log.error("%s: %s", name, exc)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    return tool_main("chaos", lambda: run(s))
