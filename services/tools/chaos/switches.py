"""Role switches as chaos: a switch begun under load, then a SIGKILL while it drains,
of the switching instance itself or of the conductor that runs it. Nothing may hang or
be lost: the instance's requests are placed again (the gateway's fault handling), and an
instance left switching without its conductor finishes the switch on its own, and the
leading conductor then settles its row (services/conductor/orphans.py). A kill waits
until the switch's row is in SQL, so a killed conductor leaves its row "draining"."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from nats.aio.client import Client as NATS

from services.tools.chaos.faults import HeartbeatVictims
from shared import bus, errors, subjects
from shared.db.schema import RoleSwitchRecord
from shared.db.session import make_engine, sessionmaker
from shared.messages import Role
from shared.role_messages import EngineRole, RoleChange, RoleChangeReply

log = logging.getLogger("halfmoon.chaos")
RECORDED_WAIT_S = 5.0  # the conductor's writes are batched every 50 ms


class Switcher:
    def __init__(
        self, nc: NATS, beats: HeartbeatVictims, rng: random.Random, database_url: str
    ) -> None:
        self.nc, self.beats, self.rng = nc, beats, rng
        self.database_url = database_url
        self.begun: list[str] = []

    async def begin(self) -> tuple[str, int] | None:
        """Start a switch of an engine instance whose role keeps another member; its (id,
        pid), or None when no switch could start. Busy ones first: their drain takes a
        while, so a kill right after lands inside it."""
        infos = [i for i in self.beats.infos() if i.role in (Role.PREFILL, Role.DECODE)]
        ready = [i for i in infos if i.status == "ready"]
        count = {r: sum(i.role == r for i in ready) for r in (Role.PREFILL, Role.DECODE)}
        eligible = [i for i in ready if count[i.role] >= 2 and i.pid]
        busy = [i for i in eligible if i.running or i.queue_depth]
        pool = busy or eligible
        if not pool:
            return None
        pick = self.rng.choice(sorted(pool, key=lambda i: i.instance_id))
        to: EngineRole = "decode" if pick.role == Role.PREFILL else "prefill"
        try:
            reply = await bus.request(
                self.nc,
                subjects.CONDUCTOR_ROLE,
                RoleChange(instance_id=pick.instance_id, role=to),
                RoleChangeReply,
                timeout_s=5.0,
            )
        except errors.HalfmoonError as exc:
            log.warning("chaos: switch of %s not started: %s", pick.instance_id, exc.message)
            return None
        self.begun.append(pick.instance_id)
        log.warning("chaos: switching %s to %s", pick.instance_id, to)
        await self.recorded(reply.switch_id)
        return pick.instance_id, pick.pid

    async def recorded(self, switch_id: str) -> None:
        """Until the switch's row is in SQL (at most RECORDED_WAIT_S)."""
        engine = make_engine(self.database_url)
        try:
            deadline = time.monotonic() + RECORDED_WAIT_S
            while time.monotonic() < deadline:
                async with sessionmaker(engine)() as s:
                    if await s.get(RoleSwitchRecord, switch_id) is not None:
                        return
                await asyncio.sleep(0.02)
            log.warning("chaos: switch %s not in SQL after %.0f s", switch_id, RECORDED_WAIT_S)
        finally:
            await engine.dispose()
