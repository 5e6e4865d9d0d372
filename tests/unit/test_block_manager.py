import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.params import SamplingParams
from shared.engine.sequence import Sequence
from shared.hashing import block_hashes


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
    assert (
        not hot & set(x.block_table) and len(bm.cached_chain(block_hashes(list(range(8)), 4))) == 2
    )
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


# ---- hash-only callers (trace replay, the simulator) ------------------------------------


def test_take_new_and_take_cached_by_hash():
    bm = BlockManager(3, 1)
    a, b = bm.take_new(11), bm.take_new(12)
    assert bm.is_cached(11) and sorted(bm.cached_hashes()) == [11, 12]
    assert bm.drain_events() == ([11, 12], [])
    bm.release([a, b])  # in order: 11 becomes the least recent
    assert bm.take_cached(12) == b and bm.take_cached(99) is None
    assert bm.blocks[b].hits == 1 and bm.blocks[b].ref_count == 1
    bm.release([b])
    assert bm.take_new(13) is not None  # the empty block first: nothing evicted
    assert bm.drain_events() == ([13], [])
    bm.release([2])
    assert bm.take_new(14) == a and bm.drain_events() == ([14], [11])  # then 11, the LRU
    with pytest.raises(ValueError):
        bm.take_new(12)  # cached: take_cached it
    bm.check_invariants()


def test_take_new_is_none_when_every_block_is_held():
    bm = BlockManager(2, 1)
    held = [bm.take_new(1), bm.take_new(2)]
    assert bm.take_new(3) is None and not bm.is_cached(3)
    bm.release(held)
    with pytest.raises(RuntimeError):
        bm.release(held[:1])  # already free
    bm.check_invariants()


def test_release_order_is_eviction_order():
    for order, first_out in (([0, 1, 2], 10), ([2, 1, 0], 12)):  # head first, tail first
        bm = BlockManager(3, 1)
        ids = [bm.take_new(h) for h in (10, 11, 12)]
        bm.release([ids[i] for i in order])
        bm.take_new(99)
        assert bm.drain_events()[1] == [first_out]


def test_add_blocks_hands_out_empty_blocks_before_evicting():
    bm = BlockManager(1, 1)
    bm.release([bm.take_new(1)])
    bm.add_blocks(2)
    assert bm.num_blocks == 3 and bm.num_empty_blocks == 2
    bm.take_new(2), bm.take_new(3)
    assert bm.drain_events()[1] == [] and bm.is_cached(1)
    with pytest.raises(ValueError):
        bm.add_blocks(0)
    bm.check_invariants()


def test_empty_blocks_are_counted_through_allocation_commit_free_and_eviction():
    bm = BlockManager(6, 4)
    s = seq("a", range(10))  # 2 full blocks and a partial one
    compute(bm, s)
    assert bm.num_empty_blocks == 3
    bm.free(s)
    assert bm.num_empty_blocks == 4  # the partial block holds nothing cached
    assert bm.evict_to_watermark(high=0.25, ratio=0.25) == 2
    assert bm.num_empty_blocks == 6
    bm.check_invariants()


@pytest.mark.parametrize(
    "blocks, high, ratio, marks",
    [
        (100, 0.9, 0.05, (90, 85)),
        (20, 0.9, 0.05, (18, 17)),
        (100_000, 0.9, 0.05, (90_000, 85_000)),
        (4, 1.0, 0.5, (4, 2)),
        (1, 0.9, 0.05, (1, 0)),
        (10, 0.5, 0.01, (5, 4)),
    ],
)
def test_watermark_marks(blocks, high, ratio, marks):
    from shared.engine.block_manager import watermark_marks

    assert watermark_marks(blocks, high, ratio) == marks


def test_watermark_marks_refuse_nonsense():
    from shared.engine.block_manager import watermark_marks

    for high, ratio in ((1.5, 0.05), (0.0, 0.0), (0.5, 0.6), (0.9, 0.0)):
        with pytest.raises(ValueError):
            watermark_marks(100, high, ratio)


def test_watermark_triggers_on_reaching_the_mark():
    bm = BlockManager(10, 1)
    held = [bm.take_new(h) for h in range(8)]
    bm.release(held)
    assert bm.evict_to_watermark(high=0.9, ratio=0.2) == 0  # 8 < 9
    bm.release([bm.take_new(8)])
    assert bm.evict_to_watermark(high=0.9, ratio=0.2) == 2  # 9: down to 7, oldest first
    assert bm.drain_events()[1] == [0, 1]


def test_an_empty_freed_block_goes_before_any_cached_one():
    """A partial tail block freed after a cached one holds nothing worth keeping: the next
    allocation takes it, not the least recently used cached block."""
    bm = BlockManager(2, 4)
    a = Sequence("a", list(range(4)), 4, SamplingParams(max_tokens=1))  # one full block
    b = Sequence("b", list(range(50, 52)), 2, SamplingParams(max_tokens=1))  # one partial
    assert bm.allocate(a, 4) and bm.allocate(b, 2)
    a.num_computed_tokens, b.num_computed_tokens = 4, 2
    bm.commit(a)
    bm.commit(b)
    empty = b.block_table[0]
    bm.free(a)  # cached, freed first
    bm.free(b)  # empty, freed after it
    c = Sequence("c", list(range(100, 103)), 3, SamplingParams(max_tokens=1))
    assert bm.allocate(c, 3)
    assert c.block_table == [empty]
    assert bm.num_cached_blocks == 1  # a's block is still cached
    bm.check_invariants()
