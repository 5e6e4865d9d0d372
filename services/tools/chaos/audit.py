"""Lost records: every request the gateway accepted must end with one terminal SQL row,
and every role switch begun must end as done or failed (none left "draining" by a
conductor killed mid-switch: the leader settles those, services/conductor/orphans.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.tools.decisions import stages_of
from shared.db.schema import TERMINAL_STATUSES, DecisionRecord, RequestRecord, RoleSwitchRecord
from shared.db.session import make_engine, sessionmaker


@dataclass
class Audit:
    rows: int = 0
    by_status: Counter = field(default_factory=Counter)
    not_terminal: list[str] = field(default_factory=list)  # rows still queued or running
    missing: list[str] = field(default_factory=list)  # ids clients were given, with no row
    pipelined: int = 0  # requests placed on a pipelined prefill group (stages > 1)
    switches_draining: list[str] = field(default_factory=list)  # role switches never ended

    @property
    def lost(self) -> int:
        return len(self.not_terminal) + len(self.missing)


async def audit(
    database_url: str, since: float, client_ids: set[str], settle_s: float = 20.0
) -> Audit:
    """Rows of requests that arrived since `since` (unix s), and of role switches begun
    since. Terminal writes are batched and off the request path, and a switch whose
    conductor was killed ends when the leader next hears its instance, so wait up to
    `settle_s` for the last ones to land."""
    engine = make_engine(database_url)
    try:
        deadline = time.monotonic() + settle_s
        while True:
            result = await _read(engine, since, client_ids)
            settled = result.lost == 0 and not result.switches_draining
            if settled or time.monotonic() >= deadline:
                return result
            await asyncio.sleep(0.5)
    finally:
        await engine.dispose()


async def _read(engine: AsyncEngine, since: float, client_ids: set[str]) -> Audit:
    t = RequestRecord
    async with sessionmaker(engine)() as s:
        rows = (await s.execute(select(t.id, t.status).where(t.arrival_time >= since))).all()
        statuses = {rid: status for rid, status in rows}
        d = DecisionRecord
        placed = (
            await s.execute(select(d.predicted_ttft_ms, d.candidates).where(d.created >= since))
        ).all()
        w = RoleSwitchRecord
        draining = (
            await s.execute(
                select(w.id, w.instance_id).where(w.requested_at >= since, w.status == "draining")
            )
        ).all()
    return Audit(
        rows=len(rows),
        by_status=Counter(statuses.values()),
        not_terminal=sorted(r for r, st in statuses.items() if st not in TERMINAL_STATUSES),
        missing=sorted(client_ids - set(statuses)),
        pipelined=sum(stages_of(p, c) > 1 for p, c in placed),
        switches_draining=sorted(f"{sid} ({iid})" for sid, iid in draining),
    )
