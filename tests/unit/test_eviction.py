"""Eviction policies: LRU order, tail-first chains, watermark batches, leases, pins."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from services.kvmanager.eviction import LRUPolicy, WatermarkPolicy


def _fill(pool: LRUPolicy | WatermarkPolicy, blocks: list[int], now: float = 0.0) -> None:
    """Each block is its own chain (no parent)."""
    for b in blocks:
        assert not pool.admit([b], now).exhausted


# ---- plain LRU ----------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_only_when_full() -> None:
    pool = LRUPolicy(3)
    _fill(pool, [1, 2, 3])
    assert pool.num_evicted == 0 and len(pool) == 3
    assert pool.touch([1, 99]) == 1
    res = pool.admit([4], now=0)
    assert res.evicted == [2] and res.inserted == [4]
    assert pool.blocks() == [3, 1, 4]
    assert pool.admit([5, 6], now=0).evicted == [3, 1]
    pool.check_invariants()


def test_admit_touches_cached_blocks_of_the_chain() -> None:
    pool = LRUPolicy(4)
    pool.admit([1, 2], now=0)
    res = pool.admit([1, 2, 3], now=0)
    assert (res.num_touched, res.inserted, res.evicted) == (2, [3], [])
    assert pool.prefix_blocks([1, 2, 3, 4]) == 3
    assert pool.prefix_blocks([2, 3]) == 2
    assert pool.prefix_blocks([9, 1]) == 0


def test_plain_lru_evicts_a_chain_head_first() -> None:
    pool = LRUPolicy(3)
    pool.admit([1, 2, 3], now=0)
    assert pool.admit([9], now=0).evicted == [1]  # 2 and 3 are now unreachable prefixes


def test_tail_first_evicts_children_before_parents() -> None:
    pool = LRUPolicy(4, tail_first=True)
    pool.admit([1, 2, 3], now=0)
    pool.touch([1])  # the root is now the most recent, but it still parents 2
    pool.admit([10], now=0)
    assert pool.admit([11], now=0).evicted == [3]
    assert pool.admit([12], now=0).evicted == [2]  # older than 10, and now a leaf
    assert pool.admit([13], now=0).evicted == [1]  # a leaf at last, and older than 10
    pool.check_invariants()


def test_tail_first_parent_goes_once_it_is_a_leaf_and_oldest() -> None:
    pool = LRUPolicy(3, tail_first=True)
    pool.admit([1, 2], now=0)
    pool.admit([7], now=0)
    assert pool.admit([8], now=0).evicted == [2]
    assert pool.admit([9], now=0).evicted == [1]


def test_lru_matches_a_reference_model_on_random_traffic() -> None:
    rng = random.Random(3)
    pool, ref = LRUPolicy(50), OrderedDict[int, None]()
    for _ in range(3000):
        chain = [rng.randrange(200) for _ in range(rng.randrange(1, 6))]
        chain = list(dict.fromkeys(chain))
        expected_evicted = []
        for b in chain:
            if b in ref:
                ref.move_to_end(b)
                continue
            if len(ref) == 50:
                expected_evicted.append(ref.popitem(last=False)[0])
            ref[b] = None
        assert pool.admit(chain, now=0).evicted == expected_evicted
    assert pool.blocks() == list(ref)
    pool.check_invariants()


# ---- leases and pins ----------------------------------------------------------------------


def test_leased_block_is_never_evicted() -> None:
    pool = LRUPolicy(2)
    _fill(pool, [1, 2])
    assert pool.acquire(1) == 1
    assert pool.admit([3], now=0).evicted == [2]
    assert pool.acquire(3) == 1
    res = pool.admit([4, 5], now=0)
    assert res.exhausted and res.rejected == [4, 5] and res.evicted == []
    assert sorted(pool.blocks()) == [1, 3]
    assert pool.release(1) == 0
    assert pool.admit([4], now=0).evicted == [1]


def test_leases_are_counted() -> None:
    pool = LRUPolicy(1)
    _fill(pool, [1])
    pool.acquire(1)
    pool.acquire(1)
    assert pool.release(1) == 1
    assert pool.admit([2], now=0).rejected == [2]
    assert pool.release(1) == 0
    assert pool.admit([2], now=0).evicted == [1]
    with pytest.raises(ValueError):
        pool.release(2)


def test_exhaustion_still_touches_cached_blocks() -> None:
    pool = LRUPolicy(2)
    _fill(pool, [1, 2])
    pool.acquire(1)
    pool.acquire(2)
    res = pool.admit([1, 3, 2, 4], now=0)
    assert res.num_touched == 2 and res.rejected == [3, 4] and res.inserted == []


def test_pins_hold_until_they_expire() -> None:
    pool = LRUPolicy(2)
    _fill(pool, [1, 2])
    pool.pin(1, now=0.0, ttl_s=10.0)
    assert pool.is_pinned(1, now=9.9) and not pool.is_pinned(1, now=10.0)
    assert pool.admit([3], now=5.0).evicted == [2]
    pool.acquire(3)
    assert pool.admit([4], now=9.0).rejected == [4]  # 1 pinned, 3 leased
    assert pool.admit([4], now=10.0).evicted == [1]  # pin expired


def test_unpin_and_pin_extension() -> None:
    pool = LRUPolicy(1)
    _fill(pool, [1])
    pool.pin(1, now=0.0, ttl_s=100.0)
    pool.pin(1, now=1.0, ttl_s=1.0)  # a shorter pin does not cut the longer one
    assert pool.is_pinned(1, now=50.0)
    assert pool.unpin(1) and not pool.unpin(1)
    assert pool.admit([2], now=0.0).evicted == [1]


def test_misuse_raises_value_error() -> None:
    pool = LRUPolicy(2)
    _fill(pool, [1])
    with pytest.raises(ValueError):
        pool.release(1)  # not leased
    with pytest.raises(ValueError):
        pool.acquire(5)  # not cached
    with pytest.raises(ValueError):
        pool.pin(5, now=0, ttl_s=1)
    with pytest.raises(ValueError):
        pool.pin(1, now=0, ttl_s=0)
    pool.acquire(1)
    with pytest.raises(ValueError):
        pool.remove(1)  # leased: needs force
    assert pool.remove(1, force=True) and not pool.remove(1)
    assert pool.lease_count(1) == 0
    with pytest.raises(ValueError):
        LRUPolicy(0)
    with pytest.raises(ValueError):
        WatermarkPolicy(10, high_watermark=1.5)
    with pytest.raises(ValueError):
        WatermarkPolicy(10, high_watermark=0.5, evict_ratio=0.6)


def test_parent_cycle_is_a_broken_invariant() -> None:
    pool = LRUPolicy(2, tail_first=True)
    pool.admit([1], now=0, parent_of=2)
    pool.admit([2], now=0, parent_of=1)  # impossible with real chained hashes
    with pytest.raises(RuntimeError):
        pool.admit([3], now=0)


def test_remove_frees_the_parent_for_tail_first_eviction() -> None:
    pool = LRUPolicy(3, tail_first=True)
    pool.admit([1, 2], now=0)
    pool.admit([5], now=0)
    assert pool.remove(2)
    pool.admit([6], now=0)
    assert pool.admit([7], now=0).evicted == [1]
    pool.check_invariants()


# ---- watermark ----------------------------------------------------------------------------


def test_watermark_triggers_at_high_and_evicts_down_by_ratio() -> None:
    pool = WatermarkPolicy(100, high_watermark=0.90, evict_ratio=0.05)
    _fill(pool, list(range(89)))
    assert pool.num_evicted == 0 and pool.num_triggers == 0
    res = pool.admit([89], now=0)
    assert res.evicted == [0, 1, 2, 3, 4]  # oldest first, down to 85
    assert len(pool) == 85 and pool.num_triggers == 1
    pool.touch([5])
    _fill(pool, list(range(100, 105)))
    assert pool.num_triggers == 2 and len(pool) == 85
    assert 5 in pool and 6 not in pool and 10 not in pool and 11 in pool


def test_watermark_occupancy_stays_between_the_marks() -> None:
    pool = WatermarkPolicy(1000)
    for b in range(10_000):
        pool.admit([b], now=0)
        assert len(pool) < 900
    assert pool.num_evicted == 10_000 - len(pool)
    assert len(pool) >= 850


def test_watermark_evicts_chain_tails_first() -> None:
    pool = WatermarkPolicy(20, high_watermark=0.5, evict_ratio=0.25)
    assert pool.admit(list(range(9)), now=0).evicted == []  # 9 blocks: under the mark
    res = pool.admit([50], now=0)  # 10 = the high mark: down to 5
    assert res.evicted == [8, 7, 6, 5, 4]  # a freed parent joins the same batch
    assert pool.prefix_blocks(range(9)) == 4
    plain = WatermarkPolicy(20, high_watermark=0.5, evict_ratio=0.25, tail_first=False)
    plain.admit(list(range(9)), now=0)
    assert plain.admit([50], now=0).evicted == [0, 1, 2, 3, 4]


def test_watermark_skips_leased_and_pinned() -> None:
    pool = WatermarkPolicy(10, high_watermark=0.9, evict_ratio=0.2)  # 9 -> 7
    _fill(pool, list(range(8)))
    pool.acquire(0)
    pool.pin(1, now=0.0, ttl_s=5.0)
    assert pool.admit([8], now=1.0).evicted == [2, 3]
    pool.release(0)
    _fill(pool, [9, 10], now=6.0)  # 9 -> 7 again; the pin on 1 has expired
    assert 0 not in pool and 1 not in pool


def test_watermark_exhaustion_when_everything_is_held() -> None:
    pool = WatermarkPolicy(4, high_watermark=1.0, evict_ratio=0.5)
    _fill(pool, [1, 2, 3])
    for b in (1, 2, 3):
        pool.acquire(b)
    res = pool.admit([4, 5], now=0)  # 4 fills the pool; nothing can go to make room
    assert (res.inserted, res.rejected, res.evicted) == ([4], [5], [])
    assert res.exhausted and len(pool) == 4
    pool.release(1)
    res = pool.admit([5], now=0)  # room again: 1 goes, and then the batch is done
    assert res.inserted == [5] and res.evicted == [1, 4]  # one batch: 4 -> 2, then 5
    pool.check_invariants()


def test_a_chain_never_evicts_itself() -> None:
    pool = LRUPolicy(3)
    _fill(pool, [9])
    res = pool.admit([1, 2, 3, 4, 5], now=0)
    assert (res.evicted, res.inserted, res.rejected) == ([9], [1, 2, 3], [4, 5])
    wm = WatermarkPolicy(10, high_watermark=0.5, evict_ratio=0.3)
    res = wm.admit(list(range(8)), now=0)
    assert res.evicted == [] and len(wm) == 8  # above the mark, but all in use now
    assert wm.admit([20], now=0).evicted == [7, 6, 5, 4, 3, 2, 1]  # 9 -> 2, 20 stays
    assert len(wm) == 2 and 20 in wm


def test_unlimited_pool_never_evicts() -> None:
    for pool in (LRUPolicy(None), WatermarkPolicy(None)):
        _fill(pool, list(range(5000)))
        assert len(pool) == 5000 and pool.num_evicted == 0
