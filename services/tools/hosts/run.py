"""The run of the hosts cluster: make the hosts, start the cluster on them, run a body (by
default: serve until a signal), stop it and remove the hosts. cli.py is the command."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.tools.hosts.cluster import HostCluster
from services.tools.hosts.netns import unavailable
from services.tools.hosts.settings import HostsSettings
from services.tools.hosts.topology import Topology, four_hosts
from shared.db import session as db
from shared.lifecycle import install_stop_signals
from shared.model_context import for_model
from shared.model_store import ensure_model

log = logging.getLogger("halfmoon.hosts")
Body = Callable[[HostCluster], Awaitable[int]]


async def run(s: HostsSettings, body: Body | None = None) -> int:
    """Make the hosts, start the cluster, then run `body` on it (by default: serve until
    a signal), stop it and remove the hosts."""
    if why := unavailable():
        log.error("halfmoon cluster: %s", why)
        return 1
    topology = four_hosts(s.run_id, s.subnet)
    cluster = HostCluster(s, topology)
    stop = asyncio.Event()
    install_stop_signals(stop)
    model_dir = await asyncio.to_thread(ensure_model, s.model)
    try:
        for_model(model_dir, s.max_model_len, s.rope_scaling)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    await db.upgrade_async(cluster.database_url)  # from the machine, as it names the server
    rc = 1
    try:
        await cluster.network_up()
        await cluster.start(model_dir)
        if not await cluster.wait_ready(stop):
            if not stop.is_set():
                log.error("the cluster did not become ready; stopping")
            return 0 if stop.is_set() else 1
        print(banner(topology, cluster), flush=True)
        if body is None:
            rc = await cluster.watch(stop)
        else:  # the supervisor runs beside it: hosts a fault killed come back
            watching = asyncio.create_task(cluster.watch(stop))
            try:
                rc = await body(cluster)
            finally:
                stop.set()
                await watching
    except (RuntimeError, TimeoutError, OSError) as exc:  # a host, NATS or leader that failed
        log.error("the cluster did not start: %s", exc)
    finally:
        log.info("stopping the cluster")
        await cluster.stop()
        log.info("stopped; hosts removed")
    return rc


def banner(t: Topology, cluster: HostCluster) -> str:
    lines = ["", f"Halfmoon is up on {len(t.hosts)} hosts (run {t.run_id}, bridge {t.bridge})."]
    for host in t.hosts:
        roles = ", ".join(host.services)
        lines.append(f"  host {host.name}  {host.address:15} {t.netns(host):14} {roles}")
    lines += [f"  API      {url}/v1" for url in t.gateway_urls()]
    lines += [
        f"  metrics  http://{cluster.where[name].address}:{port}/metrics ({name})"
        for name, port in cluster.metrics_ports.items()
    ]
    lines += [
        f"  NATS     {cluster.nats_url}",
        f"  SQL      {db.resolve_url(cluster.database_url).split('@')[-1]}",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)
