"""Hot-prefix replication in the simulator: the live conductor's plan (replication.py) on
the KV manager's heat (heat.py), its copies landing in the targets' pools as replicas."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.conductor.replication import ReplicationSettings
from services.kvmanager.hot_prefix import HotPrefixShape, hot_prefix_trace
from services.tools.sim.model import PRESETS, with_block_tokens
from services.tools.sim.results import run_policy
from services.tools.sim.run import simulate, to_sim_requests
from tests.unit.test_sim import BS, cfg, cost, req

HOT = list(range(1, 5))  # a 4-block prefix
# 10 ms per new token; a 4-block copy takes 0.4 s
COST = replace(cost(block_bytes=100), transfer_bytes_per_s=1000.0)


def flow(n: int = 40, gap_s: float = 0.1) -> list:
    """One request computes the hot prefix on p00; from 1 s on, one every `gap_s`, each
    with 2 blocks of its own (0.2 s of prefill past the prefix, 0.6 s without it): more
    than one holder can carry."""
    own = [[1000 * (i + 1), 1000 * (i + 1) + 1] for i in range(n + 1)]
    return [req(0, 0.0, HOT + own[0])] + [
        req(i, 1.0 + i * gap_s, HOT + own[i]) for i in range(1, n + 1)
    ]


def test_copies_spread_a_hot_prefix_that_largest_prefix_piles_on_its_holder():
    c = cfg(num_prefill=4, cost=COST, hot_rps=1.0, heat_half_life_s=1.0)
    on = replace(c, replication=ReplicationSettings(max_busy=0.5, bytes_per_s=1e6))
    reqs = flow()
    off_outs, _, _ = simulate(reqs, c, "largest_prefix")
    on_outs, _, cluster = simulate(reqs, on, "largest_prefix")
    assert {o.prefill_id for o in off_outs[1:]} == {"p00"}  # the holder takes them all
    copies = cluster.copies
    assert copies and copies[0].source == "p00"
    assert all(cp.block_hashes == tuple(HOT) for cp in copies)
    for k, cp in enumerate(copies):  # from the least-loaded holder: p00 or a copy landed
        assert cp.source in {"p00", *(c.target for c in copies[:k])}
    assert len({cp.target for cp in copies}) == len(copies) == 3  # each of the others once
    assert {o.prefill_id for o in on_outs} > {"p00"}  # later requests find the copies
    assert cluster.replicator.copied_bytes == 100 * 4 * len(copies)
    for cp in copies:  # each landed as replicas, and the index knows the new holder
        assert cluster.prefills[cp.target].pool.prefix_blocks(HOT) == 4
        assert cluster.index.match(HOT).per_instance[cp.target] == 4
    last_off, last_on = off_outs[-1].ttft_s, on_outs[-1].ttft_s
    assert last_on < 0.5 * last_off


def test_no_copies_without_heat_or_without_replication():
    c = cfg(num_prefill=4, cost=COST, hot_rps=1.0, heat_half_life_s=1.0)
    _, _, cluster = simulate(flow(), c, "largest_prefix")
    assert cluster.replicator is None and not cluster.copies
    slow = replace(c, replication=ReplicationSettings(), hot_rps=50.0)  # never that hot
    _, _, cluster = simulate(flow(), slow, "largest_prefix")
    assert not cluster.copies


@pytest.mark.parametrize("num_prefill", [8, 32])
def test_the_skewed_workload_replicated_cuts_ttft_p99_by_at_least_30_percent(num_prefill):
    """The issue's skewed workload: one 2k-token prefix, 80% of requests once it turns
    hot (2% before, so few instances hold it), at a rate its holder cannot carry."""
    shape = HotPrefixShape(
        requests=190 * num_prefill, rate=2.5 * num_prefill, hot_start_s=20.0, warm_share=0.02
    )
    trace = hot_prefix_trace(shape, seed=1)
    c = replace(
        cfg(num_prefill=num_prefill, num_decode=num_prefill),
        cost=with_block_tokens(PRESETS["llama3-70b-8xa800"](), 512),
        block_tokens=512,
        ttft_slo_s=30.0,
    )
    reqs = to_sim_requests(trace, 1.0)
    off = run_policy(reqs, c, "largest_prefix")
    on = run_policy(reqs, replace(c, replication=ReplicationSettings()), "largest_prefix")
    assert on.policy == "largest_prefix+replicas" and on.copies > 0
    assert on.p99_ttft_s <= 0.7 * off.p99_ttft_s and on.avg_ttft_s <= off.avg_ttft_s
    assert on.rejected <= off.rejected
    assert on.replicated_bytes == on.replicated_blocks * c.cost.block_bytes
