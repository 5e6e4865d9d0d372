"""What the P/D planner sees and decides (pure data). planner.py says how it decides.

The live conductor (services/conductor/planning.py) and the simulator
(services/tools/sim) build the same PlannerInputs from what each knows, and record the
same PlanDecision: one implementation of the rule, run in both places.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared.role_messages import EngineRole

PlannerMode = Literal["off", "advisory", "active"]


@dataclass(frozen=True)
class Arrival:
    """One request as the planner's window remembers it."""

    at_s: float
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens found in some instance's prefix cache
    max_tokens: int = 0  # what it may generate (its output length is known only at its end)


@dataclass(frozen=True)
class Finished:
    """One request that ended within the window: what it produced and whether it met its
    SLOs (TTFT and mean TBT both within them)."""

    at_s: float
    output_tokens: int
    met_slo: bool


@dataclass(frozen=True)
class Forecast:
    """Arrivals expected over the next planning horizon, and their mix."""

    rate_per_s: float
    prompt_tokens: float  # mean per request, cached ones included
    cached_tokens: float  # mean per request
    output_tokens: float  # mean per request


@dataclass(frozen=True)
class InstanceLoad:
    """One engine instance as the registry (or the simulator) sees it now."""

    instance_id: str
    role: EngineRole
    switching: bool = False  # draining towards the other role: no new work lands on it
    queue_s: float = 0.0  # prefill: predicted seconds of queued work
    running: int = 0  # decode: sequences in its batch
    mean_context: float = 0.0  # decode: mean tokens per running sequence
    kv_blocks_total: int = 0  # its KV pool (0: unknown)


@dataclass(frozen=True)
class PlannerInputs:
    now_s: float
    instances: tuple[InstanceLoad, ...]
    forecast: Forecast
    attainment: float | None  # share of the window's finished requests within their SLOs
    ttft_slo_s: float
    tbt_slo_s: float


@dataclass(frozen=True)
class SplitEstimate:
    """The cost model's prediction for `prefill`:`decode` instances under the forecast."""

    prefill: int
    decode: int
    goodput_rps: float  # requests per second predicted to meet both SLOs
    ttft_s: float  # predicted mean TTFT (inf: prefill overloaded)
    tbt_s: float  # predicted mean TBT (inf: decode overloaded)


@dataclass(frozen=True)
class Switch:
    instance_id: str
    from_role: EngineRole
    to_role: EngineRole
    drain_s: float  # predicted time to finish what it holds before it can switch


@dataclass(frozen=True)
class PlanDecision:
    now_s: float
    mode: PlannerMode
    current: tuple[int, int]  # (prefill, decode) ready, not switching
    best: tuple[int, int]  # the split of highest predicted goodput
    estimates: tuple[SplitEstimate, ...]  # every split weighed
    switch: Switch | None  # what it does (active) or would do (advisory)
    reason: str  # one line: why it switches, or why not
    inputs: PlannerInputs
    acted: bool = False  # active mode, and the switch was sent
    extra: dict[str, float] = field(default_factory=dict)
