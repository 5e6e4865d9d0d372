"""`halfmoon cluster`: Halfmoon on four hosts made of network namespaces on this machine.

  halfmoon cluster up [flags]   make the hosts, start the cluster on them, run until Ctrl-C,
                                then stop it and remove the hosts
  halfmoon cluster chaos        up, then each fault of faults.py under load, measured
  halfmoon cluster down         remove hosts an earlier run left (hm-* namespaces, bridges)

Needs root (namespaces). Tests and chaos runs start it the way a user does, and find the
hosts by the run id (--run-id) to cut links, throttle them and kill hosts (netns.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Sequence

from services.tools.hosts.cluster import HostCluster
from services.tools.hosts.netns import sweep, unavailable
from services.tools.hosts.settings import HostsSettings
from services.tools.hosts.topology import Topology, four_hosts
from shared.db import session as db
from shared.lifecycle import install_stop_signals, setup_logging
from shared.model_context import for_model
from shared.model_store import ensure_model
from shared.settings import parse_settings

log = logging.getLogger("halfmoon.hosts")
USAGE = "usage: halfmoon cluster {up,down,chaos} [--help]"
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


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "chaos":
        from services.tools.hosts import chaos

        return chaos.main(argv[1:])
    if not argv or argv[0] not in ("up", "down"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "down":
        if why := unavailable():
            print(f"halfmoon cluster down: {why}", file=sys.stderr)
            return 1
        print("\n".join(sweep()) or "nothing to remove")
        return 0
    s = parse_settings(
        HostsSettings,
        argv[1:],
        "halfmoon cluster up",
        "Halfmoon on four hosts (network namespaces on this machine; root).",
    )
    setup_logging(s.log_level, "cluster")
    try:
        return asyncio.run(run(s))
    except KeyboardInterrupt:
        return 130
