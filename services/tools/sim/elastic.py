"""The simulated cluster with the elastic P/D planner in the loop (issue 31): the live
conductor's Planner (services/conductor/planner.py), fed from the simulation's own state.

Every instance slot (i00, i01, ...) owns both a prefill and a decode instance object and
serves one role at a time; its prefill object's pool, the prefix cache, is kept across
switches, but only a slot serving prefill offers it to placement (the others are hidden
from the index's matches and from pulls). Every planner.interval_s of simulated time,
from the first arrival to the last, the cluster builds PlannerInputs (a load per slot,
the window's arrivals and finished requests, the attainment under the config's SLOs) and
calls Planner.decide with the config's cost model; every decision is kept (`plan`).

In active mode a switch is carried out as the live instances do it (SGLang's role switch,
Dynamo's planner: drain, switch, register again): the slot leaves placement at once,
finishes what it holds (its prefill queue; its decode batch and the handoffs headed its
way), then after cfg.switch_s joins the other role. A prefill drain ends exactly at its
last completion; a decode one is seen when the loop next looks at it (an arrival or a
decision) and dated at its last step's end. Advisory mode switches nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

from services.conductor.planner import Planner, attainment, forecast
from services.conductor.planner_types import (
    Arrival,
    Finished,
    InstanceLoad,
    PlanDecision,
    PlannerInputs,
    Switch,
)
from services.conductor.policy import Policy, make_policy
from services.kvmanager.pool import HashPool
from services.tools.sim.cluster import Cluster, common_prefix
from services.tools.sim.config import SimConfig
from services.tools.sim.cores import BACKGROUND
from services.tools.sim.model import Outcome, SimRequest
from services.tools.sim.outcomes import as_record
from services.tools.sim.prefill import ChunkedPrefillInstance, PrefillInstance
from shared.role_messages import EngineRole

_Prefill = PrefillInstance | ChunkedPrefillInstance


@dataclass
class SwitchRecord:
    """One switch the simulation carried out, with what it took."""

    instance_id: str
    from_role: EngineRole
    to_role: EngineRole
    decided_s: float
    predicted_drain_s: float
    drained_s: float = math.nan  # it held nothing more
    ready_s: float = math.nan  # it joined its new role (drained_s + switch_s)

    @property
    def drain_s(self) -> float:
        return self.drained_s - self.decided_s


class ElasticCluster(Cluster):
    def __init__(self, cfg: SimConfig, policy: Policy) -> None:
        if cfg.planner is None:
            raise ValueError("an elastic cluster needs cfg.planner")
        self.settings = cfg.planner
        self.planner = Planner(cfg.planner)
        self.role: dict[str, EngineRole] = {}
        self.moving: dict[str, SwitchRecord] = {}  # slots between roles
        super().__init__(cfg, policy)
        self._relist()
        self.arrivals: list[Arrival] = []  # the window's
        self.finished: list[Finished] = []  # the window's
        self.pending: list[Outcome] = []  # placed, not finished yet
        self.plan: list[PlanDecision] = []
        self.inputs_seen: list[PlannerInputs] = []  # what each decision was given
        self.switches: list[SwitchRecord] = []
        self.start_s = self.next_tick_s = self.end_s = 0.0

    def _make_instances(self) -> None:
        cfg = self.cfg
        for k in range(cfg.num_prefill + cfg.num_decode):
            slot = f"i{k:02d}"
            self.prefills[slot] = self._prefill(slot)
            self.decodes[slot] = self._decode(slot)
            self.role[slot] = "prefill" if k < cfg.num_prefill else "decode"

    def _relist(self) -> None:
        """What placement sees: the slots serving each role and not moving."""
        serving = [s for s in self.role if s not in self.moving]
        self.live_prefills = [self.prefills[s] for s in serving if self.role[s] == "prefill"]
        self.live_decodes = [self.decodes[s] for s in serving if self.role[s] == "decode"]
        self.hidden = {s for s in self.role if s in self.moving or self.role[s] != "prefill"}

    def _pool(self, instance_id: str) -> HashPool | None:
        """Pulls come only from slots serving prefill now."""
        return self.prefills[instance_id].pool if instance_id not in self.hidden else None

    # ---- the loop -----------------------------------------------------------------------

    def begin(self, first_s: float, last_s: float) -> None:
        """Decisions every interval from the first arrival to the last."""
        self.start_s, self.end_s = first_s, last_s
        self.next_tick_s = first_s + self.settings.interval_s

    def advance_to(self, t: float) -> None:
        """Handle every event, join and decision at or before `t`, in time order (at equal
        times a join goes before a decision, so that the decision sees it)."""
        while True:
            ready = min(
                (r.ready_s for r in self.moving.values() if not math.isnan(r.ready_s)),
                default=math.inf,
            )
            tick = self.next_tick_s if self.next_tick_s <= self.end_s else math.inf
            x = min(ready, tick)
            if x > t or x == math.inf:
                break
            self.run_until(x)
            if ready <= tick:
                self._join(next(r for r in self.moving.values() if r.ready_s == ready))
            else:
                self.next_tick_s += self.settings.interval_s
                self.decide(x)
        self.run_until(t)

    def arrive(self, req: SimRequest) -> None:
        super().arrive(req)  # advances every decode instance to the arrival
        out, now = self.outcomes[-1], req.arrival_s
        cached = min(self.matched_blocks * self.cfg.block_tokens, req.input_length - 1)
        self.arrivals.append(Arrival(now, req.input_length, max(0, cached), req.output_length))
        if out.rejected:
            self.finished.append(Finished(now, 0, False))
        else:
            self.pending.append(out)
        self._check_drains(now)

    def _shared_done(self, now: float, instance_id: str) -> None:
        """A slot's prefill and decode objects share its id on the shared cores; only the
        one serving the slot's role has work there (a drain ends before the role flips)."""
        if instance_id != BACKGROUND and self.role.get(instance_id) == "decode":
            self.decodes[instance_id].end_shared_step(now)
            return
        super()._shared_done(now, instance_id)

    def _prefill_done(self, inst: _Prefill, now: float) -> None:
        super()._prefill_done(inst, now)
        rec = self.moving.get(inst.instance_id)
        if rec is not None and rec.from_role == "prefill" and inst.idle:
            self._drained(rec, now, now)

    def drain(self) -> None:
        self.advance_to(math.inf)
        super().drain()
        self._check_drains(math.inf)

    # ---- deciding -----------------------------------------------------------------------

    def decide(self, now: float) -> None:
        for d in self.decodes.values():
            d.advance(now)
        self._check_drains(now)
        inputs = self.inputs(now)
        decision = self.planner.decide(inputs, self.cost)
        if decision.switch is not None and self.settings.mode == "active":
            self._begin_switch(decision.switch, now)
            decision = replace(decision, acted=True)
        self.inputs_seen.append(inputs)
        self.plan.append(decision)

    def inputs(self, now: float) -> PlannerInputs:
        cfg, window = self.cfg, min(self.settings.window_s, now - self.start_s)
        self._collect(now)
        return PlannerInputs(
            now_s=now,
            instances=tuple(self._load(slot, now) for slot in self.role),
            forecast=forecast(self.arrivals, self.finished, now, window),
            attainment=attainment(self.finished),
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
        )

    def _collect(self, now: float) -> None:
        """Move the requests that ended into the window; forget what left it."""
        cfg, still = self.cfg, []
        for o in self.pending:
            if math.isnan(o.finish_s):
                still.append(o)
                continue
            met = as_record(o, cfg.block_tokens).meets(cfg.ttft_slo_s, cfg.tbt_slo_s)
            self.finished.append(Finished(o.finish_s, o.request.output_length, met))
        self.pending = still
        since = now - self.settings.window_s
        self.arrivals = [a for a in self.arrivals if a.at_s > since]
        self.finished = [f for f in self.finished if f.at_s > since]

    def _load(self, slot: str, now: float) -> InstanceLoad:
        rec = self.moving.get(slot)
        role = rec.from_role if rec is not None else self.role[slot]
        if role == "prefill":
            return InstanceLoad(
                slot, role, rec is not None, queue_s=self.prefills[slot].view(now).queue_s
            )
        view = self.decodes[slot].view()
        return InstanceLoad(
            slot, role, rec is not None, running=view.running, mean_context=view.mean_context
        )

    # ---- switching ----------------------------------------------------------------------

    def _begin_switch(self, sw: Switch, now: float) -> None:
        if self.role[sw.instance_id] != sw.from_role or sw.instance_id in self.moving:
            raise RuntimeError(f"switch of {sw.instance_id}: not a {sw.from_role} at rest")
        rec = SwitchRecord(sw.instance_id, sw.from_role, sw.to_role, now, sw.drain_s)
        self.moving[sw.instance_id] = rec
        self.switches.append(rec)
        self._relist()
        self._check_drains(now)

    def _check_drains(self, now: float) -> None:
        """Date the drains that ended by `now` (inf: the end of the run)."""
        for rec in self.moving.values():
            if not math.isnan(rec.drained_s):
                continue
            if rec.from_role == "prefill":
                if self.prefills[rec.instance_id].idle:
                    self._drained(rec, now, now)
                continue
            dec = self.decodes[rec.instance_id]
            if dec.idle:
                self._drained(rec, max(rec.decided_s, dec.step_end_s), now)

    def _drained(self, rec: SwitchRecord, at_s: float, seen_s: float) -> None:
        """Empty at `at_s`: it registers in its new role switch_s later, or when the loop
        saw the drain (`seen_s`) if that was later still."""
        rec.drained_s = at_s
        rec.ready_s = at_s + self.cfg.switch_s
        if math.isfinite(seen_s):
            rec.ready_s = max(rec.ready_s, seen_s)

    def _join(self, rec: SwitchRecord) -> None:
        del self.moving[rec.instance_id]
        self.role[rec.instance_id] = rec.to_role
        self._relist()


def simulate_elastic(
    requests: Sequence[SimRequest], cfg: SimConfig, policy: str | Policy
) -> tuple[list[Outcome], float, ElasticCluster]:
    """run.simulate with the planner in the loop."""
    started = time.perf_counter()
    cluster = ElasticCluster(cfg, make_policy(policy) if isinstance(policy, str) else policy)
    if requests:
        if cfg.prewarm:
            cluster.prewarm(common_prefix(requests), requests[0].arrival_s)
        cluster.begin(requests[0].arrival_s, requests[-1].arrival_s)
    for req in requests:
        cluster.advance_to(req.arrival_s)
        cluster.arrive(req)
    cluster.drain()
    return cluster.outcomes, time.perf_counter() - started, cluster
