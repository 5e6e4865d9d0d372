"""`halfmoon up`: the whole local cluster on embedded defaults, one command.

Starts an embedded nats-server (unless HALFMOON_NATS_URL is given), applies migrations to
SQLite (unless HALFMOON_DATABASE_URL is given), then each service as its own process. It
waits until every service reports ready, prints the URLs, and on Ctrl-C / SIGTERM stops
them in order: intake first (gateway), then scheduling, workers, the rest, NATS last.

It supervises: a service (or the embedded nats-server) that dies is started again, with a
backoff that doubles while it keeps dying young, so a local cluster survives a crash
(`--no-restart`: a death stops the cluster instead).

settings.py holds the flags, ports.py checks the ports it will listen on before anything
starts, cluster.py the processes and their supervision, banner.py what it prints once the
cluster is ready; this module runs them in that order.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from services.up import ports
from services.up.banner import banner
from services.up.cluster import LocalCluster, restart_delay
from services.up.settings import UpSettings
from shared.db import session as db
from shared.lifecycle import install_stop_signals, setup_logging
from shared.model_context import for_model
from shared.model_store import ensure_model
from shared.natsd import EmbeddedNats
from shared.settings import parse_settings

# The public face of the package: what `halfmoon up`, chaos and bench use.
__all__ = ["LocalCluster", "UpSettings", "main", "restart_delay", "run"]

log = logging.getLogger("halfmoon.up")


async def run(s: UpSettings) -> int:
    cluster = LocalCluster(s)
    if problems := ports.taken(s, cluster.metrics_children()):
        for line in problems:  # before anything starts: one line per port, nothing to undo
            log.error(line)
        return 1
    stop = asyncio.Event()
    install_stop_signals(stop)
    model_dir = await asyncio.to_thread(ensure_model, s.model)
    try:  # a context the model cannot serve: one line now, not a crash loop per engine
        for_model(model_dir, s.max_model_len, s.rope_scaling)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    if not cluster.nats_url:
        cluster.nats = EmbeddedNats(cluster.home / "nats")
        cluster.nats_url = await asyncio.to_thread(cluster.nats.start)
    await db.upgrade_async(cluster.database_url)
    rc = 1
    try:
        await cluster.start(model_dir)
        if not await cluster.wait_ready(stop):
            if not stop.is_set():
                log.error("the cluster did not become ready; stopping")
            return 0 if stop.is_set() else 1
        print(banner(s, cluster), flush=True)
        rc = await cluster.watch(stop)
    finally:
        log.info("stopping the cluster")
        await cluster.stop()
        log.info("stopped")
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_settings(
        UpSettings, argv, "halfmoon up", "Start the whole local cluster on embedded defaults."
    )
    setup_logging(s.log_level, "up")
    try:
        return asyncio.run(run(s))
    except KeyboardInterrupt:
        return 130
