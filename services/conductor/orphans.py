"""Role switches whose conductor stopped before they ended (killed, or its lease lost
mid-drain): the instance goes on and switches, but the row the conductor wrote when the
drain began stays "draining", since only that conductor was waiting for the answer. The
leading conductor settles such rows from what it hears: done once the instance
heartbeats ready in its new role, failed once nobody could still be waiting for it.

`outcome` is the rule (pure); `settle` reads the rows and writes the verdicts.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sqlalchemy import select

from shared.db.schema import RoleSwitchRecord
from shared.db.session import sessionmaker
from shared.messages import InstanceInfo, Role
from shared.role_messages import engine_role

if TYPE_CHECKING:
    from services.conductor.handlers import Conductor

log = logging.getLogger(__name__)

# The conductor that began a switch waits for its answer this much past the drain timeout
# (roles.RoleSwitches._run); a verdict of failure waits that long again, so a conductor
# still running its switch, lease lost or not, writes the outcome it saw first.
ANSWER_MARGIN_S = 15.0


def outcome(
    to_role: str, requested_at: float, heard: InstanceInfo | None, now: float, give_up_s: float
) -> tuple[str, str] | None:
    """A draining row's verdict, as (status, detail); None while it may still be running.
    `heard`: the instance's latest live heartbeat, None when it is not heard."""
    if heard is not None and heard.status == "ready" and engine_role(heard) == to_role:
        return "done", f"ended as {to_role} while no conductor waited for it: its own had stopped"
    if now - requested_at <= give_up_s:
        return None
    if heard is None:
        return "failed", "the instance stopped before its switch was seen to end"
    return "failed", f"not seen as {to_role} within {give_up_s:.0f} s, and no conductor waited"


def give_up_s(drain_timeout_s: float, expiry_s: float) -> float:
    """How long after a switch began its own conductor may still be waiting, and then some."""
    return 2 * (drain_timeout_s + ANSWER_MARGIN_S) + expiry_s


async def settle(c: Conductor) -> int:
    """Write a verdict for every draining row this conductor does not run itself; how many."""
    if c.records is None or not c.leading():
        return 0
    mine = {p.switch_id for p in c.roles.pending.values()}
    t = RoleSwitchRecord
    async with sessionmaker(c.records.engine)() as session:
        rows = await session.execute(
            select(t.id, t.instance_id, t.to_role, t.requested_at).where(t.status == "draining")
        )
        draining = [row for row in rows.tuples() if row[0] not in mine]
    now = time.time()
    expiry = c.settings.heartbeat_expiry_s
    heard = {
        st.info.instance_id: st.info
        for st in c.registry.all()
        if now - st.last_seen <= expiry and st.info.role in (Role.PREFILL, Role.DECODE)
    }
    limit = give_up_s(c.settings.switch_drain_timeout_s, expiry)
    settled = 0
    for switch_id, instance_id, to_role, at in draining:
        verdict = outcome(to_role, at, heard.get(instance_id), now, limit)
        if verdict is None:
            continue
        status, detail = verdict
        log.warning("role switch %s of %s: %s (%s)", switch_id, instance_id, status, detail)
        c.records.role_switch(id=switch_id, status=status, finished_at=now, detail=detail)
        settled += 1
    return settled
