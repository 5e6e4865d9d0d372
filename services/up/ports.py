"""The ports `halfmoon up` will listen on, checked before it starts anything.

A second `halfmoon up` beside a running one used to start NATS, the services and the
console, log warnings about /metrics ports, and give up minutes later with "did not become
ready", without a line saying which port was taken. Now each taken port is one line that
names the port, the setting that moves it and, where /proc shows it, the process holding
it, and nothing is started. (A port can still be taken between the check and the bind; the
services then fail as before. The check is for the common case, not a lock.)
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import psutil

from services.up.settings import UpSettings


@dataclass(frozen=True)
class PortUse:
    """A port the cluster will listen on, who listens there, and the setting that moves it."""

    port: int
    what: str
    setting: str


def planned(s: UpSettings, metrics_children: int) -> list[PortUse]:
    """Every port the cluster will bind on `s.host`: the gateway's, the console's, and one
    /metrics port per child from `--metrics-base-port` up (LocalCluster._metrics_env hands
    them out in that order). The embedded nats-server takes a port the kernel picks."""
    uses = [PortUse(s.port, "the gateway", "--port (HALFMOON_PORT)")]
    if s.console:
        uses.append(
            PortUse(
                s.console_port,
                "the console",
                "--console-port (HALFMOON_CONSOLE_PORT), or --no-console",
            )
        )
    if s.metrics_base_port:
        last = min(s.metrics_base_port + metrics_children, 65536)
        uses += [
            PortUse(
                port,
                "a service's /metrics",
                "--metrics-base-port (HALFMOON_METRICS_BASE_PORT; 0 turns them off)",
            )
            for port in range(s.metrics_base_port, last)
        ]
    return uses


def is_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now. SO_REUSEADDR as aiohttp and the
    metrics server set it, so a socket of a stopped server in TIME_WAIT does not count."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def holder(port: int) -> str | None:
    """The process listening on `port`, as "pid N: command line", where /proc shows it (a
    process of another user may not be shown)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return None
            try:
                # One line, whatever the arguments hold (`python -c` code has newlines).
                cmdline = " ".join(" ".join(psutil.Process(conn.pid).cmdline()).split())
            except psutil.Error:
                return f"pid {conn.pid}"
            return f"pid {conn.pid}: {cmdline[:160]}"
    return None


def taken(s: UpSettings, metrics_children: int) -> list[str]:
    """One line per planned port that is not free; empty when the cluster can start."""
    lines = []
    for use in planned(s, metrics_children):
        if is_free(s.host, use.port):
            continue
        who = holder(use.port)
        held = f", held by {who}" if who else ""
        lines.append(
            f"port {use.port} ({use.what}) on {s.host} is taken{held}; move it with {use.setting}"
        )
    return lines
