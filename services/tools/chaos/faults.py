"""Faults: one SIGKILL at a time (no goodbye, no drain), targets in a seeded order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from services.tools.chaos.args import SWITCH_TARGETS
from shared import aio
from shared.messages import InstanceInfo

log = logging.getLogger("halfmoon.chaos")
# target -> [(name, pid)] of the processes that can be killed for it right now
Victims = Callable[[str], list[tuple[str, int]]]


@dataclass
class Kill:
    at_s: float  # since the load started
    target: str
    name: str
    pid: int


class Faults:
    def __init__(self, targets: list[str], rng: random.Random, victims: Victims) -> None:
        self.targets = targets
        self.rng = rng
        self.victims = victims
        self.kills: list[Kill] = []
        self.skipped: list[str] = []
        # The switch targets: starts a role switch, (instance id, pid) of the instance
        # switching, or None (switches.py).
        self.begin_switch: Callable[[], Awaitable[tuple[str, int] | None]] | None = None

    async def run(self, t0: float, until: float, every_s: float, stop: asyncio.Event) -> None:
        """Kill from t0 + every_s/2 on, about every `every_s`, until `until` (monotonic)."""
        order: list[str] = []
        next_at = t0 + every_s / 2
        while True:
            await aio.wait_set(stop, next_at - time.monotonic())
            if stop.is_set() or time.monotonic() >= until:
                return
            if not order:  # every target once per round, each round in a new order
                order = self.rng.sample(self.targets, len(self.targets))
            target = order.pop(0)
            if target in SWITCH_TARGETS:
                await self.kill_mid_switch(target, t0)
            else:
                self.kill(target, time.monotonic() - t0)
            next_at += every_s * self.rng.uniform(0.8, 1.2)

    async def kill_mid_switch(self, target: str, t0: float) -> None:
        """Begin a role switch, then kill the switching instance ("switching") or the
        conductor running it ("switch-conductor") while it drains."""
        begun = await self.begin_switch() if self.begin_switch is not None else None
        if begun is None:
            log.warning("chaos: no role switch could start for %s", target)
            self.skipped.append(target)
            return
        if target == "switch-conductor":
            self.kill("conductor", time.monotonic() - t0, as_target=target)
            return
        self.kill(target, time.monotonic() - t0, victims=[begun])

    def kill(
        self,
        target: str,
        at_s: float,
        victims: list[tuple[str, int]] | None = None,
        as_target: str = "",
    ) -> None:
        victims = self.victims(target) if victims is None else victims
        if not victims:
            log.warning("chaos: no live %s to kill at %.1fs", target, at_s)
            self.skipped.append(target)
            return
        name, pid = self.rng.choice(victims)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.skipped.append(target)
            return
        self.kills.append(Kill(round(at_s, 1), as_target or target, name, pid))
        log.warning("chaos: killed %s (%s, pid %d) at %.1fs", target, name, pid, at_s)


def cluster_victims(cluster: Any) -> Victims:
    """Victims in a cluster this process supervises (services.up.LocalCluster)."""

    def find(target: str) -> list[tuple[str, int]]:
        if target == "nats":
            proc = cluster.nats.proc if cluster.nats is not None else None
            return [("nats-server", proc.pid)] if proc is not None and proc.poll() is None else []
        return [
            (c.name, c.proc.pid)
            for c in cluster.children
            if c.role == target and c.proc.returncode is None
        ]

    return find


class HeartbeatVictims:
    """Victims in an attached cluster, from heartbeats (pids on this host only). Its NATS
    server is not one: nothing here could start it again."""

    def __init__(self, fresh_s: float = 3.0) -> None:
        self.fresh_s = fresh_s
        self._seen: dict[str, tuple[float, InstanceInfo]] = {}

    async def on_beat(self, msg: Any) -> None:
        with contextlib.suppress(ValueError):
            info = InstanceInfo.model_validate_json(msg.data)
            self._seen[info.instance_id] = (time.monotonic(), info)

    def __call__(self, target: str) -> list[tuple[str, int]]:
        now = time.monotonic()
        return [
            (iid, info.pid)
            for iid, (at, info) in self._seen.items()
            if info.role.value == target
            and now - at <= self.fresh_s
            and info.pid
            and info.host in ("127.0.0.1", "localhost", os.uname().nodename)
        ]

    def infos(self) -> list[InstanceInfo]:
        """The fresh heartbeats' reports (local instances only)."""
        now = time.monotonic()
        return [info for at, info in self._seen.values() if now - at <= self.fresh_s]

    def roles(self) -> set[str]:
        now = time.monotonic()
        return {info.role.value for at, info in self._seen.values() if now - at <= self.fresh_s}
