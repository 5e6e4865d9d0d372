"""A simulation's outcomes summed up per policy: the figures `halfmoon sim` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from services.conductor.planner_types import PlanDecision
from services.tools.sim.elastic import ElasticCluster, SwitchRecord
from services.tools.sim.model import Outcome, SimRequest
from services.tools.sim.run import LOCAL, SimConfig, simulate
from shared.stats import percentile


@dataclass(frozen=True)
class SimResult:
    policy: str
    requests: int
    rejected: int
    placed_over_slo: int  # the policy said reject, placed anyway (rejection disabled)
    avg_ttft_s: float
    p50_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    avg_tbt_s: float
    p99_tbt_s: float
    hit_ratio: float  # token-weighted, prefix-continuous, over placed requests
    hit_tokens: int
    input_tokens: int
    pulled_blocks: int
    pipelined: int  # requests prefilled by a group of instances
    makespan_s: float  # first arrival to last token
    wall_s: float
    # With SimConfig.planner: every decision, and the switches carried out (active mode).
    plan: tuple[PlanDecision, ...] = ()
    switches: tuple[SwitchRecord, ...] = ()
    # With SimConfig.replication: hot-prefix copies ordered, their blocks and bytes, and
    # those that found their source's blocks evicted.
    copies: int = 0
    replicated_blocks: int = 0
    replicated_bytes: int = 0
    copies_failed: int = 0


def summarize(
    policy: str,
    outcomes: Sequence[Outcome],
    wall_s: float,
    block_tokens: int,
    placed_over_slo: int = 0,
) -> SimResult:
    placed = [o for o in outcomes if not o.rejected]
    ttft = [o.ttft_s for o in placed]
    tbt = [o.tbt_s for o in placed if not math.isnan(o.tbt_s)]
    inputs = sum(o.request.input_length for o in placed)
    hits = sum(o.hit_tokens(block_tokens) for o in placed)
    start = min((o.request.arrival_s for o in outcomes), default=0.0)
    end = max((o.finish_s for o in placed), default=start)
    return SimResult(
        policy=policy,
        requests=len(outcomes),
        rejected=len(outcomes) - len(placed),
        placed_over_slo=placed_over_slo,
        avg_ttft_s=sum(ttft) / len(ttft) if ttft else math.nan,
        p50_ttft_s=percentile(ttft, 50),
        p90_ttft_s=percentile(ttft, 90),
        p99_ttft_s=percentile(ttft, 99),
        avg_tbt_s=sum(tbt) / len(tbt) if tbt else math.nan,
        p99_tbt_s=percentile(tbt, 99),
        hit_ratio=hits / inputs if inputs else 0.0,
        hit_tokens=hits,
        input_tokens=inputs,
        pulled_blocks=sum(o.pulled_blocks for o in placed),
        pipelined=sum(1 for o in placed if o.stages),
        makespan_s=end - start,
        wall_s=wall_s,
    )


def run_policy(requests: Sequence[SimRequest], cfg: SimConfig, policy: str) -> SimResult:
    if policy == LOCAL:
        cfg = replace(cfg, balancing_threshold=math.inf)
    outcomes, wall_s, cluster = simulate(requests, cfg, "kvcentric" if policy == LOCAL else policy)
    result = summarize(policy, outcomes, wall_s, cfg.block_tokens, cluster.num_placed_over_slo)
    if isinstance(cluster, ElasticCluster):
        result = replace(result, plan=tuple(cluster.plan), switches=tuple(cluster.switches))
    if cluster.replicator is not None:
        rep = cluster.replicator
        result = replace(
            result,
            policy=f"{policy}+replicas",
            copies=rep.copies,
            replicated_blocks=rep.copied_blocks,
            replicated_bytes=rep.copied_bytes,
            copies_failed=cluster.copies_failed,
        )
    return result
