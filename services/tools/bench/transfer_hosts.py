"""`halfmoon bench transfer --across-hosts`: the KV data plane between two hosts.

Makes two hosts (network namespaces with their own addresses on a bridge, as
`halfmoon cluster up` does), runs the bench's receiver on one and its sender on the other,
and removes them. Only the TCP modes run (shared memory is one host's), against the same
plain socket copy between the same two hosts, in the same rounds. Needs root.
"""

from __future__ import annotations

import ipaddress
import secrets
import subprocess
import sys

from services.tools.hosts.netns import Network, unavailable
from services.tools.hosts.topology import Host, Topology


def two_hosts() -> Topology:
    run_id = f"x{secrets.token_hex(2)}"
    net = ipaddress.ip_network(f"10.214.{secrets.randbelow(256)}.0/24")
    sender = Host("s", str(net.network_address + 11), ("sender",))
    receiver = Host("r", str(net.network_address + 12), ("receiver",))
    return Topology(run_id, str(net), (sender, receiver))


def main(argv: list[str]) -> int:
    if why := unavailable():
        print(f"halfmoon bench transfer --across-hosts: {why}", file=sys.stderr)
        return 1
    t = two_hosts()
    net = Network(t)
    net.create()
    try:
        sender, receiver = t.host("s"), t.host("r")
        cmd = [*net.launcher(receiver), sys.executable, "-m", "services.tools.bench.transfer_bench"]
        cmd += [*argv, "--sender-netns", t.netns(sender), "--bind", sender.address]
        return subprocess.run(cmd, check=False).returncode
    finally:
        net.destroy()
