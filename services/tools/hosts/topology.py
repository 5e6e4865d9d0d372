"""Which host runs what, and at which address: the pure part of the multi-host harness.

The four hosts are the shape docs/deploy.md describes for a small cluster:
- a: a gateway, the leading conductor, NATS node 1;
- b: a gateway, a standby conductor, the KV manager, NATS node 2;
- c: the prefill instances, NATS node 3;
- d: the decode instances.

Each host is a network namespace with one address on a bridge; the bridge's own address
(.1) is the machine itself, where the tests, the tools and PostgreSQL run. Nothing here
touches the network: netns.py makes what this describes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

NATS_PORT = 4222
NATS_CLUSTER_PORT = 6222
GATEWAY_PORT = 8000
# Linux caps interface names at 15 characters; every name here fits with a 6-char run id.
RUN_ID_LEN = 6


@dataclass(frozen=True)
class Host:
    name: str  # a, b, c, d
    address: str
    services: tuple[str, ...]  # roles: gateway, conductor, kvmanager, prefill, decode, nats

    def runs(self, role: str) -> bool:
        return role in self.services


@dataclass(frozen=True)
class Topology:
    run_id: str
    subnet: str  # a /24, e.g. 10.213.0.0/24
    hosts: tuple[Host, ...] = field(default=())

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    @property
    def bridge_address(self) -> str:
        """The machine's own address on the bridge: where the harness and PostgreSQL are."""
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    @property
    def bridge(self) -> str:
        return f"hmbr{self.run_id}"

    def netns(self, host: Host) -> str:
        return f"hm-{self.run_id}-{host.name}"

    def veth(self, host: Host) -> str:
        """The machine's end of the host's link (its other end is eth0 in the host)."""
        return f"hmv{self.run_id}{host.name}"

    def peer(self, host: Host) -> str:
        return f"hmp{self.run_id}{host.name}"

    def host(self, name: str) -> Host:
        found = next((h for h in self.hosts if h.name == name), None)
        if found is None:
            raise KeyError(f"no host {name!r}; hosts: {', '.join(h.name for h in self.hosts)}")
        return found

    def with_role(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.runs(role)]

    def nats_urls(self) -> list[str]:
        """Every NATS node's client URL: a service connects to all (and fails over)."""
        return [f"nats://{h.address}:{NATS_PORT}" for h in self.with_role("nats")]

    def nats_routes(self, host: Host) -> tuple[str, ...]:
        """The cluster routes of `host`'s node: every other node."""
        return tuple(
            f"nats://{h.address}:{NATS_CLUSTER_PORT}"
            for h in self.with_role("nats")
            if h.name != host.name
        )

    def gateway_urls(self) -> list[str]:
        return [f"http://{h.address}:{GATEWAY_PORT}" for h in self.with_role("gateway")]


FOUR_HOSTS: dict[str, tuple[str, ...]] = {
    "a": ("gateway", "conductor", "nats"),
    "b": ("gateway", "conductor", "kvmanager", "nats"),
    "c": ("prefill", "nats"),
    "d": ("decode",),
}


def four_hosts(run_id: str, subnet: str) -> Topology:
    """The four-host layout above, hosts at .11, .12, ... of `subnet`."""
    if len(run_id) > RUN_ID_LEN or not run_id.isalnum():
        raise ValueError(f"run id must be 1-{RUN_ID_LEN} letters or digits: {run_id!r}")
    net = ipaddress.ip_network(subnet)
    if net.num_addresses < 16:
        raise ValueError(f"subnet {subnet} is too small for the hosts (a /28 at least)")
    hosts = tuple(
        Host(name, str(net.network_address + 11 + i), roles)
        for i, (name, roles) in enumerate(FOUR_HOSTS.items())
    )
    return Topology(run_id, str(net), hosts)
