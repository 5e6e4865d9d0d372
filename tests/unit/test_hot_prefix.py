"""The hot-prefix trace: the asked share on one shared prefix, everything else fresh."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from services.kvmanager import synthetic
from services.kvmanager.hot_prefix import HotPrefixShape, hot_prefix_trace, hot_requests
from services.kvmanager.replay import replay_requests
from services.kvmanager.traces import TraceRequest, load_trace

PREFIX_BLOCKS = 2_048 // 512


def split(trace: list[TraceRequest], blocks: int = PREFIX_BLOCKS) -> tuple[list[int], list[int]]:
    """Indices of the hot requests (those sharing their first block) and the others."""
    firsts = Counter(r.hash_ids[0] for r in trace)
    hot = [i for i, r in enumerate(trace) if firsts[r.hash_ids[0]] > 1]
    return hot, [i for i in range(len(trace)) if firsts[trace[i].hash_ids[0]] == 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_hot_share_is_the_asked_one(seed):
    trace = hot_prefix_trace(HotPrefixShape(requests=2_000), seed)
    hot, _ = split(trace)
    assert abs(len(hot) / len(trace) - 0.8) < 0.03, len(hot)
    assert hot_requests(trace) == len(hot)
    low = hot_prefix_trace(HotPrefixShape(requests=2_000, hot_share=0.3), seed)
    assert abs(len(split(low)[0]) / len(low) - 0.3) < 0.03
    # 4 shared blocks of 6, on 80% of the requests
    assert abs(replay_requests(trace, None).hit_ratio - 0.8 * 4 / 6) < 0.02


def test_hot_requests_share_exactly_the_prefix_and_nothing_else_is_shared():
    trace = hot_prefix_trace(HotPrefixShape(requests=2_000), seed=4)
    hot, fresh = split(trace)
    prefix = trace[hot[0]].hash_ids[:PREFIX_BLOCKS]
    assert len(set(prefix)) == PREFIX_BLOCKS
    assert all(trace[i].hash_ids[:PREFIX_BLOCKS] == prefix for i in hot)
    uses = Counter(h for r in trace for h in r.hash_ids)
    # the prefix is in every hot request and nowhere else; every other id is used once
    assert all(uses[h] == len(hot) for h in prefix)
    assert all(n == 1 for h, n in uses.items() if h not in prefix)
    assert all(not set(trace[i].hash_ids) & set(prefix) for i in fresh)
    # ids are numbered in order of first use, as in the released traces
    order = list(dict.fromkeys(h for r in trace for h in r.hash_ids))
    assert order == list(range(len(order)))


def test_lengths_and_blocks():
    shape = HotPrefixShape(requests=300, own_tokens=700, output_tokens=17)
    trace = hot_prefix_trace(shape, seed=1)
    hot, fresh = split(trace)
    assert hot and fresh
    for r in trace:
        assert r.input_length == 2_048 + 700
        assert r.output_length == 17
        assert len(r.hash_ids) == -(-r.input_length // 512)  # the partial block has an id
    times = [r.timestamp_ms for r in trace]
    assert times == sorted(times)
    # Poisson at 4/s: 300 requests in about 75 s
    assert 60_000 < times[-1] < 90_000


def test_before_hot_start_every_request_is_fresh():
    base = HotPrefixShape(requests=2_000, rate=10.0)
    late = HotPrefixShape(requests=2_000, rate=10.0, hot_start_s=100.0)
    a, b = hot_prefix_trace(base, 3), hot_prefix_trace(late, 3)
    assert [r.timestamp_ms for r in a] == [r.timestamp_ms for r in b]  # same arrivals
    hot_a, _ = split(a)
    hot_b, _ = split(b)
    assert all(b[i].timestamp_ms >= 100_000 for i in hot_b)
    # the same requests are hot once the prefix is, none before
    assert hot_b == [i for i in hot_a if a[i].timestamp_ms >= 100_000]
    after = sum(r.timestamp_ms >= 100_000 for r in b)
    assert 900 < after < 1_100  # Poisson at 10/s: about half of 2,000 requests after 100 s
    assert abs(len(hot_b) / after - 0.8) < 0.04


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    shape = HotPrefixShape(requests=200)
    assert hot_prefix_trace(shape, 7) == hot_prefix_trace(shape, 7)
    assert hot_prefix_trace(shape, 7) != hot_prefix_trace(shape, 8)


def test_all_hot_and_none_hot():
    trace = hot_prefix_trace(HotPrefixShape(requests=50, hot_share=1.0))
    assert hot_requests(trace) == 50
    assert hot_requests(hot_prefix_trace(HotPrefixShape(requests=50, hot_share=0.0))) == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"requests": 0}, "requests"),
        ({"rate": 0.0}, "rate"),
        ({"rate": float("inf")}, "rate"),
        ({"hot_share": 1.5}, "hot_share"),
        ({"hot_share": -0.1}, "hot_share"),
        ({"hot_prefix_tokens": 1_000}, "multiple of block_tokens"),
        ({"hot_prefix_tokens": 0}, "hot_prefix_tokens"),
        ({"own_tokens": 0}, "own_tokens"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"hot_start_s": -1.0}, "hot_start_s"),
    ],
)
def test_bad_shapes_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        HotPrefixShape(**bad)


def test_the_cli_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "hot.jsonl"
    argv = ["--out", str(out), "--hot", "--requests", "400", "--rate", "8", "--seed", "2"]
    argv += ["--hot-share", "0.5", "--hot-prefix-tokens", "1024", "--own-tokens", "300"]
    assert synthetic.main([*argv, "--output-tokens", "9", "--hot-start-s", "5"]) == 0
    trace = load_trace(str(out))
    shape = HotPrefixShape(400, 8.0, 0.5, 1_024, 300, 9, hot_start_s=5.0)
    assert trace == hot_prefix_trace(shape, seed=2)
    assert all(r.input_length == 1_324 and r.output_length == 9 for r in trace)
    first = json.loads(out.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    printed = capsys.readouterr().out
    assert "400 requests" in printed and "with the hot prefix (asked 50% from 5 s)" in printed
    assert "ideal prefix hit ratio" in printed


def test_the_cli_refuses_bad_hot_flags(tmp_path, capsys):
    out = str(tmp_path / "x.jsonl")
    assert synthetic.main(["--out", out, "--hot", "--hot-prefix-tokens", "1000"]) == 2
    assert "multiple of block_tokens" in capsys.readouterr().out
    assert synthetic.main(["--out", out, "--hot-share", "0.5"]) == 2  # without --hot
    assert "only with --hot" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        synthetic.main(["--out", out, "--hot", "--shift"])
