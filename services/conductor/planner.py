"""The elastic P/D planner: how many of N engine instances serve prefill and how many
decode (pure: numbers in, a decision out; no I/O, no clock). planner_types.py holds
what it sees and decides; the live conductor and the simulator (services/tools/sim)
build the same PlannerInputs and call the same Planner.decide.

The rule (DistServe's goodput, decided online as Dynamo's planner does):
1. forecast the next minute's arrivals and their mix from a sliding window (forecast);
2. predict, with the cost model, the goodput of every split p + d = the instances not
   switching (estimate): requests/s that would meet both SLOs;
3. move at most one instance per decision towards the best split, and only when it pays:
   no switch under way, the cooldown over, a clear gain (min_gain; or the current split
   serves less than the forecast and the best more: with goodputs capped at the forecast
   that is the case that occurs), and a gain over the horizon larger than what is lost
   while the instance drains (Planner.decide).
Colocated instances (put there by hand) are left where they are, and the forecast counts
every arrival, theirs too: the planner sizes the prefill and decode pools as though they
served the whole load, which errs towards serving more.
The mode does not change the rule: "advisory" records the very decision "active" acts
on (the caller acts, and sets `acted`), so an advisory log says what active would do.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from services.conductor.costmodel import CostModel
from services.conductor.planner_types import (
    Arrival,
    Finished,
    Forecast,
    InstanceLoad,
    PlanDecision,
    PlannerInputs,
    PlannerMode,
    SplitEstimate,
    Switch,
)
from shared.role_messages import EngineRole

INF = math.inf
_TIE = 1e-9  # goodputs this close (relatively) are equal: the tie-breaks decide
# TBT is the mean of a request's slowest 10% of gaps: for a normal spread, the mean of its
# top 10% lies phi(1.2816) / 0.1 = 1.755 standard deviations above its mean (_tail_batch).
TAIL_Z = 1.755


@dataclass(frozen=True)
class PlannerSettings:
    mode: PlannerMode = "off"
    interval_s: float = 5.0  # how often it decides
    window_s: float = 30.0  # the arrivals and finished requests the forecast looks at
    min_gain: float = 0.10  # relative goodput gain a switch must bring
    cooldown_s: float = 15.0  # after a switch is decided, before the next may be
    horizon_s: float = 60.0  # how long a switch's gain is counted against its drain
    min_per_role: int = 1


# ---- forecast ------------------------------------------------------------------------------


def forecast(
    arrivals: Sequence[Arrival],
    finished: Sequence[Finished],
    now_s: float,
    window_s: float,
    ahead_s: float = 0.0,
) -> Forecast:
    """What the window (now_s - window_s, now_s] says of the next arrivals.

    Rate: the window's mean, or, when its two halves' counts differ by more than twice
    the Poisson noise of that difference, the linear trend through the halves' rates
    (r1, r2 at their middles) extrapolated to `ahead_s` after now, never below 0: a trend
    from 30 s of Poisson arrivals is mostly noise, so it counts only when clearly there.
    Callers project little (0: now; the split is weighed again every interval), and
    shorten window_s while less than a window has passed since the start.

    Means: prompt and cached tokens from the arrivals; output tokens from the requests
    that ended in the window with an output (a rejected one is Finished with 0 tokens: it
    counts against attainment, not here), else the arrivals' max_tokens, else 0."""
    start, mid = now_s - window_s, now_s - window_s / 2
    recent = [a for a in arrivals if start < a.at_s <= now_s]
    rate = len(recent) / window_s if window_s > 0 else 0.0
    first = sum(1 for a in recent if a.at_s <= mid)
    second = len(recent) - first
    if window_s > 0 and abs(second - first) > 2 * math.sqrt(len(recent)):
        half = window_s / 2
        r1, r2 = first / half, second / half
        rate = max(0.0, r2 + (r2 - r1) / half * (half / 2 + ahead_s))
    outputs = [f.output_tokens for f in finished if start < f.at_s <= now_s and f.output_tokens]
    if not outputs:
        outputs = [a.max_tokens for a in recent]
    return Forecast(
        rate_per_s=rate,
        prompt_tokens=_mean([a.prompt_tokens for a in recent]),
        cached_tokens=_mean([a.cached_tokens for a in recent]),
        output_tokens=_mean(outputs),
    )


def attainment(finished: Sequence[Finished]) -> float | None:
    """Share of the finished requests that met their SLOs (None: none finished)."""
    return sum(f.met_slo for f in finished) / len(finished) if finished else None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# ---- what a split serves -------------------------------------------------------------------


def _prefill_wait_s(rate: float, service_s: float, servers: int) -> float:
    """Mean queueing delay at `servers` prefill instances: M/D/c as Allen–Cunneen has it
    (half the M/M/c wait), with Sakasegawa's closed form for M/M/c (no loop: it runs for
    every split at every decision)."""
    rho = rate * service_s / servers
    if rho >= 1.0:
        return INF
    if rho <= 0.0:
        return 0.0
    mmc = service_s * math.pow(rho, math.sqrt(2 * (servers + 1)) - 1) / (servers * (1 - rho))
    return mmc / 2


def _prefill_limit(cost: CostModel, service_s: float, servers: int, ttft_slo_s: float) -> float:
    """The largest arrival rate whose predicted mean TTFT (overhead + wait + prefill) is
    within the SLO (bisection: the wait rises with the rate)."""
    budget = ttft_slo_s - cost.overhead_s - service_s
    if budget < 0 or servers < 1:
        return 0.0
    if service_s <= 0:
        return INF
    lo, hi = 0.0, servers / service_s
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _prefill_wait_s(mid, service_s, servers) <= budget else (lo, mid)
    return lo


def _decode_terms(cost: CostModel, fc: Forecast) -> tuple[float, float, float]:
    """(fixed step time a, time per sequence m, output tokens): a step of batch b at the
    mean context (prompt and half the output) takes a + m*b."""
    a, beta, gamma = cost.decode_coef
    context = fc.prompt_tokens + fc.output_tokens / 2
    return a, beta + gamma * context, fc.output_tokens


def _tail_batch(batch: float) -> float:
    """The batch a request's slowest gaps see. TBT is the mean of a request's slowest 10%
    of gaps (Mooncake's), so it is the step at the mean batch of the busiest tenth of the
    request's life: an instance's batch is about Poisson (sequences join and leave at
    random), so its mean plus TAIL_Z standard deviations. Sized at the mean batch, a pool
    sits at its cliff: over the SLO, admission holds every batch at the SLO's edge and
    most requests' slowest gaps cross it."""
    return batch + TAIL_Z * math.sqrt(batch)


def _decode_limit(
    cost: CostModel, fc: Forecast, instances: int, tbt_slo_s: float, kv_blocks: int | None
) -> float:
    """The largest rate whose TBT (the step at the tail batch) stays within the SLO. By
    Little's law each instance runs b = rate*out*step/instances sequences on average, and
    step = a + m*b. The SLO allows a tail batch of (S - a)/m (and, with a KV pool, no
    more sequences than fit in it whole); the mean batch b under that tail, and its step,
    give rate = instances*b/(out*step)."""
    a, m, out = _decode_terms(cost, fc)
    if out <= 0:
        return INF  # nothing to decode (or not known yet)
    if instances < 1 or tbt_slo_s <= a:
        return 0.0
    tail = (tbt_slo_s - a) / m if m > 0 else INF
    if kv_blocks is not None:
        per_seq = max(1, math.ceil((fc.prompt_tokens + out) / cost.block_size))
        tail = min(tail, kv_blocks // per_seq)
    if tail == INF:
        return INF
    root = (-TAIL_Z + math.sqrt(TAIL_Z * TAIL_Z + 4 * tail)) / 2  # b + z*sqrt(b) = tail
    batch = root * root
    return instances * batch / (out * (a + m * batch)) if batch > 0 else 0.0


def _decode_tbt_s(cost: CostModel, fc: Forecast, instances: int) -> float:
    """Predicted TBT at the forecast rate: the mean batch b = k*a/(1 - k*m), with
    k = rate*out/instances, at its tail (inf when k*m >= 1: the batch grows unbounded)."""
    a, m, out = _decode_terms(cost, fc)
    if instances < 1:
        return INF if fc.rate_per_s > 0 and out > 0 else a
    k = fc.rate_per_s * out / instances
    if k * m >= 1:
        return INF
    return a + m * _tail_batch(k * a / (1 - k * m))


def estimate(
    cost: CostModel,
    fc: Forecast,
    prefill: int,
    decode: int,
    ttft_slo_s: float,
    tbt_slo_s: float,
    kv_blocks_per_decode: int | None = None,
) -> SplitEstimate:
    """Predicted goodput of `prefill`:`decode` under the forecast: min(rate, the largest
    rate prefill serves within the TTFT SLO, the largest decode serves within the TBT SLO).
    Both pools are priced at the mean request (cost.prefill_s of its new tokens, the
    decode step at its mean context): a model of the pools' capacities, not of every
    request's latency. ttft_s and tbt_s are the predictions at the forecast rate, inf
    where that pool is overloaded."""
    service = cost.prefill_s(max(0.0, fc.prompt_tokens - fc.cached_tokens), fc.cached_tokens)
    wait = _prefill_wait_s(fc.rate_per_s, service, prefill) if prefill else INF
    limit = min(
        _prefill_limit(cost, service, prefill, ttft_slo_s),
        _decode_limit(cost, fc, decode, tbt_slo_s, kv_blocks_per_decode),
    )
    return SplitEstimate(
        prefill=prefill,
        decode=decode,
        goodput_rps=min(fc.rate_per_s, limit),
        ttft_s=cost.overhead_s + service + wait,
        tbt_s=_decode_tbt_s(cost, fc, decode),
    )


def utilisation(cost: CostModel, fc: Forecast, prefill: int, decode: int) -> float:
    """The busier pool's load: prefill's rate*service/instances, decode's k*m (1: full)."""
    service = cost.prefill_s(max(0.0, fc.prompt_tokens - fc.cached_tokens), fc.cached_tokens)
    _, m, out = _decode_terms(cost, fc)
    p = fc.rate_per_s * service / prefill if prefill else INF
    d = fc.rate_per_s * out * m / decode if decode else INF
    return max(p, d)


# ---- deciding ------------------------------------------------------------------------------


def drain_s(cost: CostModel, fc: Forecast, inst: InstanceLoad) -> float:
    """Predicted time for `inst` to finish what it holds. Prefill: its queue. Decode: until
    the last of its sequences ends; their remaining outputs are about uniform on (0, out],
    so the longest of n has n/(n+1)*out tokens left, at no more than today's step each."""
    if inst.role == "prefill":
        return inst.queue_s
    if inst.running <= 0:
        return 0.0
    steps = fc.output_tokens * inst.running / (inst.running + 1)
    return steps * cost.decode_step_s(inst.running, inst.mean_context)


def _label(split: tuple[int, int]) -> str:
    return f"{split[0]}P+{split[1]}D"


def _phrases(fc: Forecast, cur: SplitEstimate, best: SplitEstimate) -> tuple[str, str]:
    """What the current split serves, and what the best would: a reason's parts."""
    return (
        f"{_label((cur.prefill, cur.decode))} serves {cur.goodput_rps:.2f} of "
        f"{fc.rate_per_s:.2f} req/s",
        f"{_label((best.prefill, best.decode))} would serve {best.goodput_rps:.2f}",
    )


class Planner:
    """Decides every settings.interval_s; remembers only when it last switched (so that
    replaying the same inputs through a fresh Planner gives the same decisions)."""

    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings
        self.last_switch_s: float | None = None

    def decide(self, inputs: PlannerInputs, cost: CostModel) -> PlanDecision:
        s = self.settings
        # Colocated instances were put there by hand: the planner weighs prefill:decode
        # splits of the others and leaves those where they are.
        ready = [i for i in inputs.instances if not i.switching and i.role != "colocated"]
        current = (
            sum(i.role == "prefill" for i in ready),
            sum(i.role == "decode" for i in ready),
        )
        if s.mode == "off":  # nothing weighed: a caller may also simply not call it
            return PlanDecision(
                inputs.now_s, "off", current, current, (), None, "planner off", inputs
            )
        fc = inputs.forecast
        kv = min(
            (i.kv_blocks_total for i in ready if i.role == "decode" and i.kv_blocks_total > 0),
            default=None,
        )

        def est(p: int, d: int) -> SplitEstimate:
            return estimate(cost, fc, p, d, inputs.ttft_slo_s, inputs.tbt_slo_s, kv)

        n, m = len(ready), s.min_per_role
        weighed = tuple(est(p, n - p) for p in range(m, n - m + 1))
        by_split = {(e.prefill, e.decode): e for e in weighed}
        cur = by_split.get(current) or est(*current)
        best = self._best(weighed, current, cost, fc) or cur
        switch, reason = self._switch(inputs, fc, cost, ready, cur, best, est)
        if switch is not None:
            self.last_switch_s = inputs.now_s
        best_split = (best.prefill, best.decode)
        return PlanDecision(
            inputs.now_s, s.mode, current, best_split, weighed, switch, reason, inputs
        )

    @staticmethod
    def _best(
        weighed: Sequence[SplitEstimate], current: tuple[int, int], cost: CostModel, fc: Forecast
    ) -> SplitEstimate | None:
        """Highest goodput; among equals the split closest to the current one (a switch
        costs a drain), then the least loaded, then fewer prefill instances."""
        if not weighed:
            return None
        top = max(e.goodput_rps for e in weighed)
        tied = [e for e in weighed if e.goodput_rps >= top * (1 - _TIE)]
        return min(
            tied,
            key=lambda e: (
                abs(e.prefill - current[0]),
                utilisation(cost, fc, e.prefill, e.decode),
                e.prefill,
            ),
        )

    def _held(
        self, inputs: PlannerInputs, fc: Forecast, cur: SplitEstimate, best: SplitEstimate
    ) -> str:
        """Why no switch may be made now ("" when one may): the current split is the best,
        a switch is under way, the cooldown runs, or the gain is too small."""
        s, now, would = self.settings, inputs.now_s, _phrases(fc, cur, best)[1]
        if (cur.prefill, cur.decode) == (best.prefill, best.decode):
            return ", the best split"
        moving = [i.instance_id for i in inputs.instances if i.switching]
        if moving:
            return f", {would}; {moving[0]} is switching"
        if self.last_switch_s is not None and now - self.last_switch_s < s.cooldown_s:
            return f", {would}; cooldown, {s.cooldown_s - (now - self.last_switch_s):.0f} s left"
        short = cur.goodput_rps < fc.rate_per_s * (1 - _TIE)
        if best.goodput_rps >= cur.goodput_rps * (1 + s.min_gain) or (
            short and best.goodput_rps > cur.goodput_rps * (1 + _TIE)
        ):
            return ""
        return f", {would}: under the {s.min_gain:.0%} a switch needs"

    def _switch(
        self,
        inputs: PlannerInputs,
        fc: Forecast,
        cost: CostModel,
        ready: Sequence[InstanceLoad],
        cur: SplitEstimate,
        best: SplitEstimate,
        est: Callable[[int, int], SplitEstimate],
    ) -> tuple[Switch | None, str]:
        """The one switch towards `best` that pays, or None and why not."""
        s, serves, would = self.settings, *_phrases(fc, cur, best)
        held = self._held(inputs, fc, cur, best)
        if held:
            return None, f"holding: {serves}{held}"
        here, there = (cur.prefill, cur.decode), (best.prefill, best.decode)
        grow: EngineRole = "prefill" if there[0] > here[0] else "decode"
        shrink: EngineRole = "decode" if grow == "prefill" else "prefill"
        step = (1, -1) if grow == "prefill" else (-1, 1)
        without = (here[0] - (shrink == "prefill"), here[1] - (shrink == "decode"))
        if min(without) < s.min_per_role:
            return None, f"holding: {serves}; {shrink} is at its minimum of {s.min_per_role}"
        inst = min(
            (i for i in ready if i.role == shrink),
            key=lambda i: (drain_s(cost, fc, i), i.instance_id),
        )
        drain = drain_s(cost, fc, inst)
        # One step's gain, from the end of the drain to the horizon, against what the
        # shrinking pool loses while the instance drains (nothing when it has capacity to
        # spare): a drain as long as the horizon never pays.
        nxt = est(here[0] + step[0], here[1] + step[1])
        gain = (nxt.goodput_rps - cur.goodput_rps) * max(0.0, s.horizon_s - drain)
        lost = (cur.goodput_rps - est(*without).goodput_rps) * drain
        if gain <= lost:
            return None, (
                f"holding: {serves}, {would}; {gain:.1f} more requests within "
                f"{s.horizon_s:.0f} s do not pay for {inst.instance_id}'s {drain:.1f} s "
                f"drain ({lost:.1f} lost)"
            )
        why = f"{grow} short" if cur.goodput_rps < fc.rate_per_s * (1 - _TIE) else "rebalancing"
        return Switch(inst.instance_id, shrink, grow, drain), (
            f"{why}: {serves}, {would}; {inst.instance_id} {shrink} -> {grow} "
            f"(drain ~{drain:.1f} s)"
        )


# ---- records -------------------------------------------------------------------------------


def decision_record(d: PlanDecision) -> dict[str, Any]:
    """One decision as plain JSON-able data (the plan_decisions row): inf and nan are None."""
    sw = d.switch
    return {
        "created": d.now_s,
        "mode": d.mode,
        "current_prefill": d.current[0],
        "current_decode": d.current[1],
        "best_prefill": d.best[0],
        "best_decode": d.best[1],
        "switch_instance": sw.instance_id if sw else None,
        "switch_from": sw.from_role if sw else None,
        "switch_to": sw.to_role if sw else None,
        "drain_s": _finite(sw.drain_s) if sw else None,
        "acted": d.acted,
        "reason": d.reason,
        "attainment": d.inputs.attainment,
        "forecast": _finite(asdict(d.inputs.forecast)),
        "instances": [_finite(asdict(i)) for i in d.inputs.instances],
        "estimates": [_finite(asdict(e)) for e in d.estimates],
    }


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x
