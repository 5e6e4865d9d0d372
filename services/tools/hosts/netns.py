"""Hosts as Linux network namespaces on this machine, and the faults a network has.

`Network.create()` makes, for a Topology: a bridge on the machine with the bridge address,
and per host a namespace with loopback up and one veth link to the bridge (eth0 inside,
with the host's address). Then a link can go down and up (`link`), be throttled with a
token bucket filter (`throttle`: tc tbf both ways; netem is not in every kernel), and a
host can lose every process it runs at once (`kill_host`), as when a machine dies.

Everything is made with `ip` and `tc` from iproute2, and needs root (CAP_NET_ADMIN).
`destroy()` removes it all, and `sweep()` what an earlier run left behind.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import subprocess

from services.tools.hosts.topology import Host, Topology

log = logging.getLogger("halfmoon.hosts")


def unavailable() -> str:
    """Why hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return ""


def ip(*args: str, netns: str = "", check: bool = True) -> str:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


def in_netns(netns: str, *cmd: str, check: bool = True) -> str:
    full = ["ip", "netns", "exec", netns, *cmd]
    done = subprocess.run(full, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {done.stderr.strip()}")
    return done.stdout


class Network:
    def __init__(self, topology: Topology) -> None:
        self.t = topology

    def launcher(self, host: Host) -> tuple[str, ...]:
        """The command prefix that runs a program on `host` (it execs: the pid stays)."""
        return ("ip", "netns", "exec", self.t.netns(host))

    def create(self) -> None:
        t = self.t
        if taken := addresses_in(t.subnet):
            raise RuntimeError(
                f"subnet {t.subnet} is in use here ({', '.join(taken)}): choose another "
                "(--subnet), or remove an earlier run's hosts (halfmoon cluster down)"
            )
        try:
            ip("link", "add", t.bridge, "type", "bridge")
            ip("addr", "add", f"{t.bridge_address}/{t.prefix_len}", "dev", t.bridge)
            ip("link", "set", t.bridge, "up")
            for host in t.hosts:
                self._add_host(host)
        except Exception:
            self.destroy()
            raise

    def _add_host(self, host: Host) -> None:
        t, ns = self.t, self.t.netns(host)
        ip("netns", "add", ns)
        ip("link", "set", "lo", "up", netns=ns)
        ip("link", "add", t.veth(host), "type", "veth", "peer", "name", t.peer(host))
        ip("link", "set", t.veth(host), "master", t.bridge)
        ip("link", "set", t.veth(host), "up")
        ip("link", "set", t.peer(host), "netns", ns)
        ip("link", "set", t.peer(host), "name", "eth0", netns=ns)
        ip("addr", "add", f"{host.address}/{t.prefix_len}", "dev", "eth0", netns=ns)
        ip("link", "set", "eth0", "up", netns=ns)
        ip("route", "add", "default", "via", t.bridge_address, netns=ns)

    def pids(self, host: Host) -> list[int]:
        out = ip("netns", "pids", self.t.netns(host), check=False)
        return [int(p) for p in out.split()]

    def kill_host(self, host: Host) -> list[int]:
        """SIGKILL every process on `host`, the way a machine that loses power stops."""
        pids = _kill(self.pids(host))
        log.warning("host %s: killed %d processes", host.name, len(pids))
        return pids

    def link(self, host: Host, up: bool) -> None:
        """Take `host`'s only link down (it is cut off from every other host) or up."""
        ip("link", "set", self.t.veth(host), "up" if up else "down")
        log.warning("host %s: link %s", host.name, "up" if up else "down")

    def throttle(self, host: Host, mbit: float) -> None:
        """Shape `host`'s link to `mbit` Mbit/s each way (tc tbf on both ends of the veth)."""
        rate = f"{mbit}mbit"
        # A burst of about 10 ms at the rate (at least a few packets) keeps tbf accurate.
        burst = f"{max(16, int(mbit * 1000 / 8 / 100))}kb"
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", "50ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.t.veth(host), *tbf], check=True)
        in_netns(self.t.netns(host), "tc", "qdisc", "replace", "dev", "eth0", *tbf)
        log.warning("host %s: link throttled to %s", host.name, rate)

    def unthrottle(self, host: Host) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.t.veth(host), "root"], check=False)
        in_netns(self.t.netns(host), "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def destroy(self) -> None:
        """Kill what runs on the hosts and remove every namespace, link and the bridge."""
        for host in self.t.hosts:
            ns = self.t.netns(host)
            if ns in namespaces():
                _kill(self.pids(host))
            ip("netns", "del", ns, check=False)
            ip("link", "del", self.t.veth(host), check=False)  # gone with the netns, mostly
        ip("link", "del", self.t.bridge, check=False)


def _kill(pids: list[int]) -> list[int]:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def addresses_in(subnet: str) -> list[str]:
    """Addresses this machine already has in `subnet` (another run's bridge, say)."""
    net = ipaddress.ip_network(subnet)
    found = []
    for line in ip("-o", "-4", "addr", "show", check=False).splitlines():
        words = line.split()
        if "inet" in words:
            addr = words[words.index("inet") + 1].split("/")[0]
            if ipaddress.ip_address(addr) in net:
                found.append(addr)
    return found


def namespaces() -> list[str]:
    out = ip("netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep() -> list[str]:
    """Remove every host namespace and bridge an earlier harness run left (hm-* / hmbr*)."""
    removed = []
    for ns in namespaces():
        if ns.startswith("hm-"):
            _kill([int(p) for p in ip("netns", "pids", ns, check=False).split()])
            ip("netns", "del", ns, check=False)
            removed.append(ns)
    for line in ip("-o", "link", "show", "type", "bridge", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("hmbr"):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed
