"""Trace replay: exact hit ratios on a crafted trace and on the head of the real one."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from services.kvmanager import traces
from services.kvmanager.pool import POLICIES, HashPool
from services.kvmanager.replay import main, replay_requests, replay_trace
from services.kvmanager.traces import SAMPLE_TRACE, load_trace

REPO = Path(__file__).resolve().parents[2]
# The repository's sample: 276 requests, 2% of the conversation trace's conversations.
SAMPLE = str(SAMPLE_TRACE)

# (input_length, hash_ids); the expected figures below are worked out by hand.
SYNTHETIC = [
    (1200, [1, 2, 3]),  # cold: 0
    (1600, [1, 2, 4, 5]),  # 2 leading blocks: 1024
    (2000, [8, 9, 10]),  # cold: 0 (in a 4-block pool it pushes 1, 2 and 4 out)
    (700, [1, 2]),  # unlimited: 2 blocks = 1024 tokens, capped at the input: 700
    (1000, [6, 2]),  # 2 is cached but not leading: 0
]
TOTAL_INPUT = 1200 + 1600 + 2000 + 700 + 1000


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": 1000 * i, "input_length": n, "output_length": 10, "hash_ids": h})
        for i, (n, h) in enumerate(SYNTHETIC)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_unlimited_pool_exact_ratio(synthetic: Path) -> None:
    for policy in ("lru", "watermark"):
        r = replay_trace(str(synthetic), None, policy)
        assert (r.hit_tokens, r.input_tokens) == (1024 + 700, TOTAL_INPUT)
        assert r.hit_ratio == (1024 + 700) / TOTAL_INPUT
        assert r.num_requests == 5 and r.num_requests_with_hit == 2
        assert r.mean_request_hit_ratio == pytest.approx((1024 / 1600 + 1.0) / 5)
        assert (r.blocks_inserted, r.blocks_evicted, r.peak_blocks) == (9, 0, 9)
        assert r.avg_occupancy_blocks == pytest.approx((3 + 5 + 8 + 8 + 9) / 5)
        assert r.avg_occupancy_ratio is None and r.warm_occupancy_blocks is None


def test_small_lru_pool_exact_ratio(synthetic: Path) -> None:
    # C=4: r2 hits 1,2, then 5 evicts 3 -> {1,2,4,5}; r3 evicts 1, 2, 4 -> {5,8,9,10};
    # r4 misses 1; its blocks evict 5, 8; r5: 6 evicts 9.
    r = replay_trace(str(synthetic), 4, "lru")
    assert r.hit_tokens == 1024 and r.hit_ratio == 1024 / TOTAL_INPUT
    assert (r.blocks_inserted, r.blocks_evicted, r.blocks_rejected) == (11, 7, 0)
    assert r.warm_occupancy_blocks == pytest.approx(4.0)


def test_tail_first_keeps_the_prefix(synthetic: Path) -> None:
    # C=4 tail-first: r2 as above -> chain 1-2-4-5; r3 evicts 5, 4, 2 (tails first)
    # -> {1,8,9,10}; r4 hits 1 (512 tokens), its 2 evicts 10; r5: 6 evicts 9.
    r = replay_trace(str(synthetic), 4, "lru", tail_first=True)
    assert r.hit_tokens == 1024 + 512
    assert (r.blocks_inserted, r.blocks_evicted, r.blocks_rejected) == (10, 6, 0)


def test_chain_longer_than_the_pool_is_partly_rejected(synthetic: Path) -> None:
    # C=3: in r2, 4 evicts 3, and 5 finds only blocks of its own chain -> rejected.
    r = replay_trace(str(synthetic), 3, "lru")
    assert r.blocks_rejected >= 1 and r.peak_blocks == 3


def _set_based_hits(
    requests: list[tuple[int, list[int]]], block_tokens: int = 512
) -> tuple[int, int]:
    seen: set[int] = set()
    hit = total = 0
    for n_tokens, hashes in requests:
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hit += min(n * block_tokens, n_tokens)
        total += n_tokens
        seen.update(hashes)
    return hit, total


def _ordered_dict_lru_hits(requests: list[tuple[int, list[int]]], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for n_tokens, hashes in requests:
        n = 0
        while n < len(hashes) and hashes[n] in cache:
            n += 1
        hit += min(n * 512, n_tokens)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hit


@pytest.fixture(scope="module")
def sample() -> list[tuple[int, list[int]]]:
    with open(SAMPLE) as f:
        return [(d["input_length"], d["hash_ids"]) for d in map(json.loads, f)]


def test_sample_unlimited_matches_set_model(sample: list[tuple[int, list[int]]]) -> None:
    hit, total = _set_based_hits(sample)
    assert 0 < hit < total
    requests = load_trace(SAMPLE)
    for policy in ("lru", "watermark"):
        r = replay_requests(requests, None, policy)
        assert (r.hit_tokens, r.input_tokens) == (hit, total)
        assert r.hit_ratio == hit / total


def test_sample_lru_matches_reference_model(sample: list[tuple[int, list[int]]]) -> None:
    requests = load_trace(SAMPLE)
    r = replay_requests(requests, 1000, "lru")
    assert r.hit_tokens == _ordered_dict_lru_hits(sample, 1000)
    assert r.blocks_evicted > 0 and r.peak_blocks == 1000


def test_cli_json_and_table(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--trace", str(synthetic), "--capacity-blocks", "inf", "4", "--policy", "lru"]
    assert main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["capacity_blocks"], row["hit_tokens"]) for row in rows] == [
        (None, 1724),
        (4, 1024),
    ]
    assert main(["--trace", str(synthetic), "--capacity-blocks", "unlimited", "4"]) == 0
    out = capsys.readouterr().out
    assert "watermark" in out and " lru " in out and "26.52" in out  # 1724 / 6500


def test_cli_rejects_bad_input(synthetic: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--trace", str(synthetic), "--capacity-blocks", "lots"])
    with pytest.raises(SystemExit):
        main(["--trace", str(synthetic), "--capacity-blocks", "0"])
    assert main(["--trace", str(tmp_path / "missing.jsonl"), "--capacity-blocks", "inf"]) == 2


def test_module_entry_point(synthetic: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.kvmanager.replay",
            "--trace",
            str(synthetic),
            "--capacity-blocks",
            "inf",
            "--policy",
            "lru",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(proc.stdout)["hit_tokens"] == 1724


# ---- the pool the replay and the simulator run: the engines' BlockManager, by hash --------


def _fill(pool: HashPool, blocks: list[int], now: float = 0.0) -> None:
    """Each block is its own chain."""
    for b in blocks:
        assert not pool.admit([b], now).exhausted


def test_lru_evicts_least_recently_used_only_when_full() -> None:
    pool = HashPool(3)
    _fill(pool, [1, 2, 3])
    assert pool.num_evicted == 0 and len(pool) == 3
    assert pool.touch([1, 99]) == 1
    res = pool.admit([4], now=0)
    assert res.evicted == [2] and res.inserted == [4]
    assert pool.admit([5, 6], now=0).evicted == [3, 1]
    assert sorted(pool.cached()) == [4, 5, 6]
    pool.check_invariants()


def test_admit_touches_cached_blocks_of_the_chain() -> None:
    pool = HashPool(4)
    pool.admit([1, 2], now=0)
    res = pool.admit([1, 2, 3], now=0)
    assert (res.num_touched, res.inserted, res.evicted) == (2, [3], [])
    assert pool.prefix_blocks([1, 2, 3, 4]) == 3
    assert pool.prefix_blocks([2, 3]) == 2 and pool.prefix_blocks([9, 1]) == 0


def test_plain_lru_evicts_a_chain_head_first() -> None:
    pool = HashPool(3)
    pool.admit([1, 2, 3], now=0)
    assert pool.admit([9], now=0).evicted == [1]  # 2 and 3 are now unreachable prefixes


def test_tail_first_evicts_children_before_parents() -> None:
    pool = HashPool(4, tail_first=True)
    pool.admit([1, 2, 3], now=0)
    pool.touch([1])  # the root is now the most recent, but it still parents 2
    pool.admit([10], now=0)
    assert pool.admit([11], now=0).evicted == [3]
    assert pool.admit([12], now=0).evicted == [2]  # older than 10, and now a leaf
    assert pool.admit([13], now=0).evicted == [1]  # a leaf at last, and older than 10
    pool.check_invariants()


def test_lru_matches_a_reference_model_on_random_traffic() -> None:
    rng = random.Random(3)
    pool, ref = HashPool(50), OrderedDict[int, None]()
    for _ in range(3000):
        chain = list(dict.fromkeys(rng.randrange(200) for _ in range(rng.randrange(1, 6))))
        expected_evicted = []
        for b in chain:
            if b in ref:
                ref.move_to_end(b)
                continue
            if len(ref) == 50:
                expected_evicted.append(ref.popitem(last=False)[0])
            ref[b] = None
        assert pool.admit(chain, now=0).evicted == expected_evicted
    assert sorted(pool.cached()) == sorted(ref)
    pool.check_invariants()


def test_a_chain_never_evicts_itself() -> None:
    pool = HashPool(3)
    _fill(pool, [9])
    res = pool.admit([1, 2, 3, 4, 5], now=0)
    assert (res.evicted, res.inserted, res.rejected) == ([9], [1, 2, 3], [4, 5])
    wm = HashPool(10, "watermark", high_watermark=0.5, evict_ratio=0.3)
    res = wm.admit(list(range(8)), now=0)
    assert res.evicted == [] and len(wm) == 8  # above the mark, but all in use now
    assert wm.admit([20], now=0).evicted == [7, 6, 5, 4, 3, 2, 1]  # 9 -> 2, 20 stays
    assert len(wm) == 2 and 20 in wm


def test_watermark_triggers_at_high_and_evicts_down_by_ratio() -> None:
    pool = HashPool(100, "watermark", high_watermark=0.90, evict_ratio=0.05)
    _fill(pool, list(range(89)))
    assert pool.num_evicted == 0
    assert pool.admit([89], now=0).evicted == [0, 1, 2, 3, 4]  # oldest first, down to 85
    pool.touch([5])
    _fill(pool, list(range(100, 105)))
    assert len(pool) == 85 and 5 in pool and 6 not in pool and 10 not in pool and 11 in pool


def test_watermark_occupancy_stays_between_the_marks() -> None:
    pool = HashPool(1000, "watermark")
    for b in range(10_000):
        pool.admit([b], now=0)
        assert len(pool) < 900
    assert pool.num_evicted == 10_000 - len(pool) and len(pool) >= 850


def test_watermark_evicts_chain_tails_first_by_default() -> None:
    pool = HashPool(20, "watermark", high_watermark=0.5, evict_ratio=0.25)
    assert pool.admit(list(range(9)), now=0).evicted == []  # 9 blocks: under the mark
    assert pool.admit([50], now=0).evicted == [8, 7, 6, 5, 4]  # 10 = the mark: down to 5
    assert pool.prefix_blocks(range(9)) == 4
    plain = HashPool(20, "watermark", tail_first=False, high_watermark=0.5, evict_ratio=0.25)
    plain.admit(list(range(9)), now=0)
    assert plain.admit([50], now=0).evicted == [0, 1, 2, 3, 4]


def test_a_full_watermark_pool_makes_room_with_a_batch() -> None:
    # A chain longer than the room under the mark leaves the pool full; the next insert
    # evicts a batch down to the low mark first (not one block), then goes in.
    pool = HashPool(10, "watermark", high_watermark=0.5, evict_ratio=0.3)
    assert pool.admit(list(range(12)), now=0).rejected == [10, 11] and len(pool) == 10
    assert pool.admit([50], now=0).evicted == [9, 8, 7, 6, 5, 4, 3, 2]
    assert len(pool) == 3


def test_unlimited_pool_never_evicts() -> None:
    for policy in POLICIES:
        pool = HashPool(None, policy)
        _fill(pool, list(range(10_000)))
        assert len(pool) == 10_000 and pool.num_evicted == 0
        pool.check_invariants()


def test_pool_misuse_is_a_value_error() -> None:
    for bad in (
        dict(capacity_blocks=0),
        dict(capacity_blocks=4, policy="mru"),
        dict(capacity_blocks=4, policy="watermark", high_watermark=1.5),
        dict(capacity_blocks=4, policy="watermark", high_watermark=0.5, evict_ratio=0.6),
    ):
        with pytest.raises(ValueError):
            HashPool(**bad)


# ---- traces: the default, the sample, the conversation trace's reference column ---------


def test_the_default_trace_is_the_env_else_the_repository_sample(monkeypatch) -> None:
    monkeypatch.delenv("HALFMOON_TRACE", raising=False)
    assert traces.default_trace() == str(SAMPLE_TRACE) and SAMPLE_TRACE.is_file()
    monkeypatch.setenv("HALFMOON_TRACE", "/data/mine.jsonl")
    assert traces.default_trace() == "/data/mine.jsonl"


def test_the_sample_keeps_whole_conversations_in_file_order() -> None:
    from services.tools.bench.replay.workload import keeps

    requests = load_trace(SAMPLE)
    assert len(requests) == 276 and all(keeps(r, traces.SAMPLE_CONVERSATIONS) for r in requests)
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    assert not traces.is_conversation_trace(requests)


@pytest.mark.skipif(not os.environ.get("HALFMOON_TRACE"), reason="HALFMOON_TRACE not set")
def test_the_sample_is_the_default_bench_slice_of_the_conversation_trace() -> None:
    from services.tools.bench.replay.workload import SliceSpec, select

    full = load_trace(os.environ["HALFMOON_TRACE"])
    if not traces.is_conversation_trace(full):
        pytest.skip("HALFMOON_TRACE is not the conversation trace")
    spec = SliceSpec(sample_conversations=traces.SAMPLE_CONVERSATIONS)
    assert select(full, spec) == load_trace(SAMPLE)


def test_digest_is_of_the_content_not_the_formatting(tmp_path: Path, synthetic: Path) -> None:
    compact = tmp_path / "compact.jsonl"
    compact.write_text(
        "".join(
            json.dumps(json.loads(line), separators=(",", ":")) + "\n\n"
            for line in synthetic.read_text().splitlines()
        )
    )
    digest = traces.trace_digest(load_trace(str(synthetic)))
    assert traces.trace_digest(load_trace(str(compact))) == digest
    assert traces.trace_digest(load_trace(str(synthetic), limit=4)) != digest


def test_reference_column_only_for_the_conversation_trace(
    synthetic: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--trace", str(synthetic), "--capacity-blocks", "inf", "1000"]
    assert main(argv) == 0
    assert "ref %" not in capsys.readouterr().out
    # Pretend the synthetic trace is the conversation trace: docs/design.md's figures appear
    # beside plain LRU, and only there (not for watermark, nor tail-first LRU).
    monkeypatch.setattr(
        traces, "CONVERSATION_TRACE_DIGEST", traces.trace_digest(load_trace(str(synthetic)))
    )
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ref %" in lines[1]
    assert lines[3].split()[:4] == ["inf", "lru", "26.52", "37.4"]
    assert lines[4].split()[:4] == ["inf", "watermark", "26.52", "-"]
    assert lines[5].split()[3] == "4.5"
    assert main([*argv, "--tail-first", "on", "--policy", "lru"]) == 0
    assert capsys.readouterr().out.splitlines()[3].split()[3] == "-"
    assert main([*argv, "--block-tokens", "16"]) == 0
    assert "ref %" not in capsys.readouterr().out
