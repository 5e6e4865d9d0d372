"""The P/D planner in the live conductor: every interval it builds PlannerInputs from
what the conductor knows, runs planner.py's rule (the simulator runs the same), records
the decision in SQL and, in active mode, starts the switch it chose (roles.py, with the
same checks as a switch by hand).

What goes in:
- the load: each engine instance's role, whether it is switching, its queued prefill
  work (priced by the cost model, as placement prices it), its batch and context, and its
  KV pool, all from the registry;
- the arrivals: each request this conductor placed (or refused), with its prompt, its
  longest cached prefix and its max_tokens, kept for one window;
- what ended: the requests SQL says finished in the window, each with its output length
  and whether it met the conductor's default SLOs (TTFT, and mean TBT over its output).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from sqlalchemy import select

from services.conductor import snapshot
from services.conductor.planner import Planner, PlannerSettings, decision_record, forecast
from services.conductor.planner_types import (
    Arrival,
    Finished,
    InstanceLoad,
    PlanDecision,
    PlannerInputs,
)
from shared import aio, errors
from shared.db.schema import RequestRecord, RequestStatus
from shared.db.session import sessionmaker
from shared.messages import GenerateRequest
from shared.role_messages import RoleChange, engine_role

if TYPE_CHECKING:
    from services.conductor.parts import ConductorParts
    from services.conductor.roles import RoleSwitches

log = logging.getLogger(__name__)


def met_slo(rec: RequestRecord, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """A finished request's TTFT, and its mean gap after the first token, within the SLOs
    (shared/run_summary.py's rule, from the columns SQL keeps)."""
    if rec.status != RequestStatus.COMPLETED or rec.ttft_ms is None:
        return False
    gaps = max(rec.completion_tokens - 1, 0)
    tbt_s = ((rec.e2e_ms or rec.ttft_ms) - rec.ttft_ms) / 1e3 / gaps if gaps else 0.0
    return rec.ttft_ms / 1e3 <= ttft_slo_s and tbt_s <= tbt_slo_s


class PlannerLoop:
    def __init__(
        self, conductor: ConductorParts, roles: RoleSwitches, settings: PlannerSettings
    ) -> None:
        self.c = conductor
        self.roles = roles
        self.settings = settings
        self.planner = Planner(settings)
        self.arrivals: deque[Arrival] = deque()
        self.started_s = time.time()
        self.last: PlanDecision | None = None

    def note(self, req: GenerateRequest, matches: dict[str, int], now: float) -> None:
        """A request the conductor decided on (placed or refused)."""
        if self.settings.mode == "off":
            return
        block = self.c.cost.block_size
        cached = min(max(matches.values(), default=0) * block, len(req.prompt_token_ids))
        self.arrivals.append(
            Arrival(now, len(req.prompt_token_ids), cached, req.sampling.max_tokens)
        )
        while self.arrivals and self.arrivals[0].at_s < now - self.settings.window_s:
            self.arrivals.popleft()

    def loads(self, now: float) -> tuple[InstanceLoad, ...]:
        cost, switching = self.c.cost, self.c.registry.switching
        out = []
        for state in self.c.registry.all():
            info = state.info
            role = engine_role(info)
            if role is None or now - state.last_seen > self.c.registry.expiry_s:
                continue
            out.append(
                InstanceLoad(
                    info.instance_id,
                    role,
                    switching=info.status != "ready" or info.instance_id in switching,
                    queue_s=snapshot.prefill_view(state, cost).queue_s,
                    running=info.running,
                    mean_context=info.mean_context,
                    kv_blocks_total=info.kv_blocks_total,
                )
            )
        return tuple(sorted(out, key=lambda i: i.instance_id))

    async def finished(self, since: float) -> list[Finished]:
        records = self.c.records
        if records is None:
            return []
        s = self.c.settings
        ttft, tbt = s.ttft_slo_ms / 1e3, s.tbt_slo_ms / 1e3
        async with sessionmaker(records.engine)() as session:
            rows = (
                await session.execute(
                    select(RequestRecord).where(
                        RequestRecord.finish_time > since,
                        RequestRecord.status != RequestStatus.CANCELLED,
                    )
                )
            ).scalars()
            return [
                Finished(r.finish_time or since, r.completion_tokens, met_slo(r, ttft, tbt))
                for r in rows
            ]

    async def inputs(self, now: float) -> PlannerInputs:
        # Less than a window since the start: the window is what has passed (the rate
        # would read low otherwise).
        window = min(self.settings.window_s, max(now - self.started_s, 1.0))
        done = await self.finished(now - window)
        s = self.c.settings
        fc = forecast(list(self.arrivals), done, now, window)
        return PlannerInputs(
            now_s=now,
            instances=self.loads(now),
            forecast=fc,
            attainment=sum(f.met_slo for f in done) / len(done) if done else None,
            ttft_slo_s=s.ttft_slo_ms / 1e3,
            tbt_slo_s=s.tbt_slo_ms / 1e3,
        )

    async def tick(self) -> PlanDecision:
        decision = self.planner.decide(await self.inputs(time.time()), self.c.cost)
        if self.settings.mode == "active" and decision.switch is not None:
            decision = self._act(decision)
        self.last = decision
        if self.c.records is not None:
            self.c.records.plan_decision(**decision_record(decision))
        if decision.switch is not None:
            log.info("planner (%s): %s", decision.mode, decision.reason)
        return decision

    def _act(self, d: PlanDecision) -> PlanDecision:
        assert d.switch is not None
        change = RoleChange(
            instance_id=d.switch.instance_id, role=d.switch.to_role, source="planner"
        )
        try:
            self.roles.begin(change)
        except errors.HalfmoonError as exc:  # the registry moved since the inputs were read
            return replace(d, reason=f"{d.reason}; not sent: {exc.message}")
        return replace(d, acted=True)

    async def run(self, stop: asyncio.Event) -> None:
        """Decide every interval while this conductor leads (a standby's view of the
        arrivals is empty: it places nothing)."""
        while not stop.is_set():
            await aio.wait_set(stop, self.settings.interval_s)
            if stop.is_set() or not self.c.leading():
                continue
            try:
                await self.tick()
            except Exception:  # a planning fault must not take placement down with it
                log.exception("planner tick failed")
