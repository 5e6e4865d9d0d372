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
import sys
from typing import Sequence

from services.tools.hosts import chaos
from services.tools.hosts.netns import sweep, unavailable
from services.tools.hosts.run import run
from services.tools.hosts.settings import HostsSettings
from shared.lifecycle import setup_logging
from shared.settings import parse_settings

USAGE = "usage: halfmoon cluster {up,down,chaos} [--help]"


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "chaos":
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
