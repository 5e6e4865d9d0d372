"""Hot-prefix replication's pure parts: the KV manager's heat (kvmanager/heat.py), the
conductor's plan and its budget (conductor/replication.py), and the pool's eviction that
takes a replica before a block that may be the last copy (block_manager.py)."""

from __future__ import annotations

import math

import pytest

from services.conductor.costmodel import CostModel
from services.conductor.replication import ReplicationSettings, Replicator, TokenBucket
from services.conductor.views import InstanceView, RequestView, Snapshot
from services.kvmanager.heat import PrefixHeat
from services.kvmanager.pool import HashPool
from shared.engine.block_manager import BlockManager

# Prefill = 1 ms per new token; 16-token blocks of 1,000 bytes.
COST = CostModel(
    prefill_coef=[0.0, 1e-3, 0.0, 0.0],
    decode_coef=[0.01, 1e-3, 0.0],
    transfer_latency_s=0.0,
    block_bytes=1000,
    block_size=16,
    overhead_s=0.0,
)
HOT = [101, 102, 103, 104]  # a 4-block prefix, then each request's own blocks
HASHES = [*HOT, 7, 8]


def snap(*queues: tuple[str, float]) -> Snapshot:
    return Snapshot([InstanceView(i, queue_s=q) for i, q in queues], [], COST)


def view(holders: dict[str, int], heat_rps: float, hot: int = 4, **kw) -> RequestView:
    # 96 tokens: past the 64-token prefix, 32 tokens = 32 ms of prefill on a holder
    return RequestView("r", 96, holders, 10.0, 1.0, hot_blocks=hot, heat_rps=heat_rps, **kw)


# ---- heat ---------------------------------------------------------------------------


def test_heat_is_a_decayed_hit_rate_and_a_prefix_is_as_hot_as_its_last_block():
    heat = PrefixHeat(half_life_s=1.0)
    tau = 1 / math.log(2)
    for k in range(200):  # 10 hits/s for 20 s on the prefix; its 4th block half as often
        heat.hit(HOT[:3] + ([HOT[3]] if k % 2 else []), k / 10)
    assert heat.rate(HOT[0], 19.9) == pytest.approx(10.0, rel=0.1)
    assert heat.rate(HOT[3], 19.9) == pytest.approx(5.0, rel=0.1)
    assert heat.hot_run(HASHES, 19.9, min_rps=6.0) == (3, heat.rate(HOT[2], 19.9))
    assert heat.hot_run(HASHES, 19.9, min_rps=4.0)[0] == 4
    assert heat.hot_run([7, *HOT], 19.9, min_rps=0.1) == (0, 0.0)  # a cold first block
    later = 19.9 + 3 * tau  # three time constants: e^-3 of the rate is left
    assert heat.rate(HOT[0], later) == pytest.approx(10.0 * math.exp(-3), rel=0.1)
    assert heat.hot_run(HASHES, later, min_rps=1.0)[0] == 0


def test_heat_keeps_the_hotter_half_when_full():
    heat = PrefixHeat(half_life_s=10.0, max_blocks=10)
    for _ in range(5):
        heat.hit([1, 2, 3], 0.0)
    for h in range(100, 108):
        heat.hit([h], 0.0)
    assert len(heat) <= 10 and all(heat.rate(h, 0.0) > 0 for h in (1, 2, 3))
    with pytest.raises(ValueError):
        PrefixHeat(half_life_s=0)


# ---- the plan -----------------------------------------------------------------------


def test_a_hot_prefix_is_copied_from_its_least_loaded_holder_to_the_least_loaded_other():
    rep = Replicator(ReplicationSettings(max_busy=0.5))
    s = snap(("p0", 2.0), ("p1", 1.0), ("p2", 0.5), ("p3", 0.1))
    # 50 req/s x 32 ms = 1.6 instance-seconds a second: 4 holders at 50% busy
    copy = rep.plan(s, view({"p0": 4, "p1": 6}, 50.0), HASHES, now=0.0)
    assert copy is not None
    assert (copy.source, copy.target, copy.block_hashes) == ("p1", "p3", tuple(HOT))
    assert (copy.holders, copy.wanted, copy.nbytes) == (2, 4, 4000)
    assert "50.00 req/s" in copy.reason and "wants 4 holders" in copy.reason
    # in flight, p3 counts as a holder: the next copy goes to p2, and then none
    assert rep.plan(s, view({"p0": 4, "p1": 6}, 50.0), HASHES, 0.1).target == "p2"
    assert rep.plan(s, view({"p0": 4, "p1": 6}, 50.0), HASHES, 0.2) is None
    assert (rep.copies, rep.copied_blocks, rep.copied_bytes) == (2, 8, 8000)


def test_no_copy_while_the_holders_carry_the_heat_or_nothing_is_hot():
    rep = Replicator(ReplicationSettings(max_busy=0.5))
    s = snap(("p0", 0.0), ("p1", 0.0))
    assert rep.plan(s, view({"p0": 4}, 10.0), HASHES, 0.0) is None  # 0.32 s/s: one will do
    assert rep.plan(s, view({"p0": 4}, 50.0, hot=0), HASHES, 0.0) is None  # not hot
    assert rep.plan(s, view({}, 50.0), HASHES, 0.0) is None  # nobody holds it
    off = Replicator(ReplicationSettings(enabled=False))
    assert off.plan(s, view({"p0": 4}, 50.0), HASHES, 0.0) is None


def test_a_holder_with_the_prefix_on_disk_only_is_no_source_and_no_holder():
    rep = Replicator(ReplicationSettings(max_busy=0.5))
    s = snap(("p0", 0.0), ("p1", 0.0), ("p2", 0.0))
    v = view({"p0": 4, "p1": 4}, 50.0, disk_blocks={"p1": 2})
    copy = rep.plan(s, v, HASHES, 0.0)
    assert copy is not None and copy.source == "p0" and copy.target == "p1"


def test_replication_respects_its_budget_of_blocks_and_bytes():
    # 8 blocks/s, saved up to one second's worth: two 4-block copies a second
    rep = Replicator(ReplicationSettings(max_busy=0.01, blocks_per_s=8.0, bytes_per_s=1e9))
    s = snap(*((f"p{i}", 0.0) for i in range(40)))  # wants all 40: the budget binds
    copied = 0
    for k in range(100):  # 10 s of hot requests at 10 a second
        t = k / 10
        if rep.plan(s, view({"p0": 4}, 50.0), HASHES, t) is not None:
            copied += 4
        assert copied <= 8 + 8 * t + 1e-9  # never past the budget
    assert rep.throttled > 0 and copied >= 80  # and the budget was used
    by_bytes = Replicator(ReplicationSettings(max_busy=0.01, bytes_per_s=4000.0))
    assert by_bytes.plan(s, view({"p0": 4}, 50.0), HASHES, 0.0) is not None
    assert by_bytes.plan(s, view({"p0": 4}, 50.0), HASHES, 0.5) is None  # 2,000 bytes back
    assert by_bytes.plan(s, view({"p0": 4}, 50.0), HASHES, 1.0) is not None


def test_a_copy_bigger_than_a_second_of_budget_waits_for_a_full_bucket():
    bucket = TokenBucket(10.0)
    assert bucket.can_take(25)
    bucket.take(25)  # in debt: 15 units
    bucket.refill(1.0)
    assert not bucket.can_take(25)
    bucket.refill(2.5)
    assert bucket.can_take(25)


def test_a_copy_that_never_lands_is_forgotten_after_pending_s():
    rep = Replicator(ReplicationSettings(max_busy=0.2, pending_s=5.0))
    s = snap(("p0", 0.0), ("p1", 0.0))
    assert rep.plan(s, view({"p0": 4}, 10.0), HASHES, 0.0).target == "p1"
    assert rep.plan(s, view({"p0": 4}, 10.0), HASHES, 4.0) is None  # still in flight
    assert rep.plan(s, view({"p0": 4}, 10.0), HASHES, 6.0).target == "p1"  # failed: again
    with pytest.raises(ValueError):
        ReplicationSettings(max_busy=0.0)


# ---- eviction -----------------------------------------------------------------------


def test_eviction_takes_a_replica_before_a_block_that_may_be_the_last_copy():
    bm = BlockManager(4, 1)
    own = [bm.take_new(h) for h in (1, 2)]
    copied = [bm.take_new(h) for h in (11, 12)]
    assert bm.mark_replicas([11, 12, 99]) == 2
    bm.release(copied)  # the replicas are freed first...
    bm.release(own)  # ...and the own blocks last, yet the replicas go first
    bm.drain_events()
    bm.take_new(20), bm.take_new(21)
    assert bm.drain_events()[1] == [11, 12]
    bm.take_new(22)
    assert bm.drain_events()[1] == [1]  # no replica left: least recently freed
    bm.check_invariants()


def test_a_pinned_replica_waits_and_a_reused_replica_slot_is_no_replica():
    bm = BlockManager(3, 1)
    ids = [bm.take_new(h) for h in (1, 11, 12)]
    bm.mark_replicas([11, 12])
    bm.release(ids)
    bm.pin([11], ttl_s=60.0)
    bm.take_new(20)
    assert bm.drain_events()[1] == [12]  # the unpinned replica
    assert not bm.blocks[ids[2]].replica  # its slot now holds block 20, no copy
    bm.take_new(21)
    assert bm.drain_events()[1] == [1]  # the pinned replica outlives the own block
    bm.check_invariants()


def test_watermark_eviction_takes_replicas_first():
    bm = BlockManager(10, 1)
    own = [bm.take_new(h) for h in range(1, 6)]
    copied = [bm.take_new(h) for h in range(11, 15)]
    bm.mark_replicas(range(11, 15))
    bm.release(own + copied)
    bm.drain_events()
    assert bm.evict_to_watermark(high=0.9, ratio=0.5) == 5
    assert sorted(bm.drain_events()[1]) == [1, 11, 12, 13, 14]
    bm.check_invariants()


def test_a_hash_pool_admits_a_copy_as_replicas():
    pool = HashPool(4)
    pool.admit([1, 2], now=0.0)
    pool.admit([11, 12], now=1.0, replica=True)
    res = pool.admit([21, 22], now=2.0)
    assert sorted(res.evicted) == [11, 12] and 1 in pool and 2 in pool
    pool.check_invariants()
