"""The synthetic trace: the paper's averages, from any seed, and the structure behind them."""

from __future__ import annotations

import statistics

import pytest

from services.kvmanager.replay import replay_requests
from services.kvmanager.synthetic import (
    PAPER_CACHE_RATIO,
    PAPER_MEAN_INPUT,
    PAPER_MEAN_OUTPUT,
    SyntheticShape,
    synthetic_trace,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_seed_has_the_papers_averages(seed):
    trace = synthetic_trace(seed=seed)
    assert len(trace) == 3_993
    mean_in = statistics.mean(r.input_length for r in trace)
    mean_out = statistics.mean(r.output_length for r in trace)
    hit = replay_requests(trace, None).hit_ratio  # docs/design.md's rule, unlimited pool
    assert abs(mean_in / PAPER_MEAN_INPUT - 1) < 0.08, mean_in
    assert abs(mean_out / PAPER_MEAN_OUTPUT - 1) < 0.08, mean_out
    assert abs(hit - PAPER_CACHE_RATIO) < 0.03, hit
    # Poisson arrivals at 3.9/s: 3,993 requests in about 1,024 s
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1e3
    assert 950 < span_s < 1100, span_s


def test_blocks_match_the_lengths_and_repeats_share_whole_document_blocks():
    trace = synthetic_trace(SyntheticShape(requests=600), seed=5)
    first_use: dict[int, int] = {}
    repeats = 0
    for i, r in enumerate(trace):
        assert len(r.hash_ids) == -(-r.input_length // 512)  # one id per (partial) block
        shared = 0
        for h in r.hash_ids:
            if h not in first_use:
                break
            shared += 1
        assert shared * 512 <= r.input_length  # only whole blocks are ever shared
        repeats += shared > 0
        for h in r.hash_ids:
            first_use.setdefault(h, i)
    # ids are numbered in order of first use, as in the released traces
    assert sorted(first_use) == list(range(len(first_use)))
    assert [first_use[h] for h in sorted(first_use)] == sorted(first_use.values())
    assert 0.35 < repeats / len(trace) < 0.6  # 70% documents x 69% repeats


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    a, b = (
        synthetic_trace(SyntheticShape(requests=200), 7),
        synthetic_trace(SyntheticShape(requests=200), 7),
    )
    assert a == b
    assert a != synthetic_trace(SyntheticShape(requests=200), 8)


def test_the_long_document_shape_asks_8k_to_32k_documents_several_times():
    from services.kvmanager.synthetic import LONG_DOCUMENTS

    trace = synthetic_trace(LONG_DOCUMENTS, seed=3)
    inputs = [r.input_length for r in trace]
    assert min(inputs) >= 8_192 and max(inputs) <= 32_768
    docs = {r.hash_ids[0] for r in trace}  # every request starts with its document
    assert len(trace) / len(docs) >= 4  # several questions per document
    assert replay_requests(trace, None).hit_ratio > 0.7
