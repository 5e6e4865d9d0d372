import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence
from shared.hashing import block_hashes
from shared.messages import SamplingParams


def seq(rid, tokens, salt=""):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=4), salt)


def compute(bm, s, n=None):
    """Pretend the model computed `n` (default: all) tokens of `s`."""
    n = s.num_uncomputed_tokens if n is None else n
    assert bm.allocate(s, n)
    s.num_computed_tokens += n
    return bm.commit(s)


def test_allocate_and_free_counts():
    bm = BlockManager(8, 4)
    s = seq("a", range(10))
    assert bm.allocate(s, 10) and len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.allocate(seq("b", range(30)), 30)  # exhaustion is a return value
    assert bm.num_free_blocks == 5  # and takes nothing
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []
    bm.check_invariants()


def test_commit_uses_the_shared_chained_hash():
    bm = BlockManager(8, 4)
    s = seq("a", range(10))
    assert compute(bm, s) == block_hashes(list(range(10)), 4)
    assert bm.num_cached_blocks == 2


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    bm = BlockManager(16, 4)
    a = seq("a", range(12))
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    b = seq("b", list(range(12)))  # identical prompt: 3 full blocks cached
    assert bm.match_prefix(b) == 8  # the last block is recomputed so logits exist
    assert b.block_table == a_blocks[:2] and b.num_cached_tokens == 8
    c = seq("c", list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.match_prefix(c) == 8
    d = seq("d", [1000] + list(range(1, 12)))
    assert bm.match_prefix(d) == 0


def test_salt_isolates_prefixes():
    bm = BlockManager(16, 4)
    a = seq("a", range(12), salt="tenant-a")
    compute(bm, a)
    assert bm.match_prefix(seq("b", range(12), salt="tenant-b")) == 0
    assert bm.match_prefix(seq("c", range(12), salt="tenant-a")) == 8


def test_free_blocks_stay_cached_until_reused_tail_first():
    bm = BlockManager(4, 4)
    a = seq("a", range(16))
    hashes = compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    # one new block needed: the chain's tail (block 3) is evicted, not its parents
    assert bm.allocate(seq("x", [7] * 4), 4)
    assert bm.drain_events() == (hashes, [hashes[3]])
    probe = seq("p", range(16))
    assert bm.match_prefix(probe) == 12


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(8, 4)
    a = seq("a", range(9))
    compute(bm, a)
    b = seq("b", range(9))
    bm.match_prefix(b)
    shared = b.block_table[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in shared)
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in shared)
    bm.free(b)
    with pytest.raises(RuntimeError):
        bm.free(Sequence("z", [1], 1, SamplingParams(), block_table=[shared[0]]))
    bm.check_invariants()


def test_misuse_is_a_value_error():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    bm = BlockManager(4, 4)
    s = seq("a", range(8))
    bm.allocate(s, 4)
    with pytest.raises(ValueError):
        bm.match_prefix(s)


def test_hot_blocks_are_soft_pinned_until_their_ttl():
    bm = BlockManager(4, 4, hot_hits=2, pin_ttl_s=10)
    bm.now = 100.0
    a = seq("a", range(9))  # 2 full blocks + 1 partial
    compute(bm, a)
    bm.free(a)
    for rid in ("b", "c"):  # two hits on a's prefix: hot
        s = seq(rid, range(9))
        bm.match_prefix(s)
        bm.free(s)
    hot = set(bm.cached_chain(block_hashes(list(range(8)), 4)))
    x = seq("x", [50] * 8)
    assert bm.allocate(x, 8)  # 2 blocks: the unpinned ones go, the hot prefix stays
    assert not hot & set(x.block_table) and len(bm.cached_chain(block_hashes(list(range(8)), 4))) == 2
    bm.free(x)
    bm.now = 111.0  # pins expired: plain LRU again
    y = seq("y", [60] * 16)
    assert bm.allocate(y, 16)
    assert bm.cached_chain(block_hashes(list(range(8)), 4)) == []


def test_a_soft_pin_yields_when_nothing_else_is_free():
    bm = BlockManager(2, 4)
    a = seq("a", range(8))
    compute(bm, a)
    bm.free(a)
    bm.now = 0.0
    assert bm.pin(block_hashes(list(range(8)), 4), ttl_s=100) == 2
    assert bm.allocate(seq("x", [9] * 8), 8)  # soft: pinned blocks still give way


def test_watermark_evicts_down_by_the_ratio_and_spares_leases_and_pins():
    bm = BlockManager(20, 4)
    held = []
    hashes = []
    for i in range(19):  # 19 of 20 blocks hold cached data: 95% > 90%
        s = seq(f"s{i}", [i] * 4 + [0])
        hashes.append(compute(bm, s, 4))
        held.append(s)
    for s in held[1:]:
        bm.free(s)  # held[0] keeps its lease
    bm.pin(hashes[1], ttl_s=10)
    evicted = bm.evict_to_watermark(high=0.9, ratio=0.05)
    assert evicted == 2  # 19 -> 17 = 85% of 20
    assert bm.cached_chain(hashes[0]) and bm.cached_chain(hashes[1])  # leased, pinned: kept
    assert not bm.cached_chain(hashes[2]) and not bm.cached_chain(hashes[3])  # oldest went
    assert bm.evict_to_watermark(high=0.9, ratio=0.05) == 0  # below the mark: nothing
