"""The event loop: a trace through the simulated cluster (cluster.py) under one policy;
with SimConfig.planner, through the elastic cluster that runs the P/D planner in the loop
(elastic.py)."""

from __future__ import annotations

import time
from typing import Sequence

from services.conductor.policy import Policy, make_policy
from services.kvmanager.traces import TraceRequest
from services.tools.sim.cluster import Cluster, common_prefix
from services.tools.sim.config import SimConfig
from services.tools.sim.elastic import simulate_elastic
from services.tools.sim.model import Outcome, SimRequest

__all__ = ["LOCAL", "Cluster", "SimConfig", "common_prefix", "simulate", "to_sim_requests"]

# kvcentric with an infinite balancing threshold never pulls: the paper's "local
# cache-aware" baseline (queue + prefill on each instance's own cache), same code.
LOCAL = "kvcentric_local"


def to_sim_requests(trace: Sequence[TraceRequest], time_scale: float) -> list[SimRequest]:
    return [
        SimRequest(
            i, r.timestamp_ms / 1000.0 * time_scale, r.input_length, r.output_length, r.hash_ids
        )
        for i, r in enumerate(trace)
    ]


def simulate(
    requests: Sequence[SimRequest], cfg: SimConfig, policy: str | Policy
) -> tuple[list[Outcome], float, Cluster]:
    """Run the whole trace; returns the outcomes (trace order), wall seconds, the cluster."""
    if cfg.planner is not None:
        return simulate_elastic(requests, cfg, policy)
    started = time.perf_counter()
    cluster = Cluster(cfg, make_policy(policy) if isinstance(policy, str) else policy)
    if cfg.prewarm and requests:
        cluster.prewarm(common_prefix(requests), requests[0].arrival_s)
    for req in requests:
        cluster.run_until(req.arrival_s)
        cluster.arrive(req)
    cluster.drain()
    return cluster.outcomes, time.perf_counter() - started, cluster
