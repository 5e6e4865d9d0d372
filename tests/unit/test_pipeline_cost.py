"""The predicted times of a pipelined prefill: the flow shop over stages and chunks, against
what it must reduce to (one stage: the single instance's prediction) and closed forms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.conductor.costmodel import CostModel
from services.conductor.pipeline import (
    balanced_split,
    chunk_sizes,
    chunk_work,
    hop_s,
    pipelined,
    prefill_end_s,
)

# Linear in tokens, no step overhead, no attention terms: every full chunk costs the same.
LINEAR = CostModel(
    prefill_coef=[0.0, 1e-3, 0.0, 0.0],
    transfer_latency_s=0.0,
    transfer_bytes_per_s=1e18,
    num_layers=30,
    chunk_tokens=512,
)


def test_layers_split_evenly_and_chunks_cover_the_prompt():
    assert balanced_split(30, 2) == [(0, 15), (15, 30)]
    assert balanced_split(30, 4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    with pytest.raises(ValueError):
        balanced_split(3, 4)
    assert chunk_sizes(1100, 512) == [512, 512, 76] and chunk_sizes(1024, 512) == [512, 512]


def test_the_chunks_work_sums_to_the_whole_prompts_prediction():
    cost = CostModel()  # the default fit: step overhead and both attention terms
    for new, cached in [(100, 0), (16_000, 0), (4_000, 2_048)]:
        assert sum(chunk_work(cost, new, cached)) == pytest.approx(cost.prefill_s(new, cached))
    later = chunk_work(cost, 16_000, 0)
    assert later[-2] > later[1]  # a later chunk attends to more: it costs more


def test_one_stage_is_the_single_instance():
    cost = CostModel()
    (only,) = pipelined(cost, 16_000, 0, [0.25])
    assert only.layers == (0, 30) and only.start_s == 0.25
    assert only.end_s == pytest.approx(0.25 + cost.prefill_s(16_000, 0))


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_equal_stages_overlap_all_but_the_fill(stages):
    """S equal stages over C equal chunks of work w: the last ends at (C + S - 1) * w / S."""
    chunks, w = 32, 0.512
    times = pipelined(LINEAR, chunks * 512, 0, [0.0] * stages)
    assert prefill_end_s(times) == pytest.approx((chunks + stages - 1) * w / stages)
    assert [t.layers for t in times] == balanced_split(30, stages)
    if stages == 2:  # 16k tokens on two stages: 0.52x of one instance
        assert prefill_end_s(times) / (chunks * w) == pytest.approx(33 / 64)


def test_hops_and_a_busy_stage_delay_the_end():
    cost = replace(LINEAR, transfer_latency_s=0.01)
    base = prefill_end_s(pipelined(LINEAR, 4096, 0, [0.0, 0.0]))
    hopping = pipelined(cost, 4096, 0, [0.0, 0.0])
    # A hop shorter than a stage's chunk only shows once, in filling the pipe.
    assert prefill_end_s(hopping) == pytest.approx(base + hop_s(cost, 512))
    busy = pipelined(LINEAR, 4096, 0, [0.0, 5.0])
    assert busy[1].start_s == 5.0
    assert prefill_end_s(busy) == pytest.approx(5.0 + 8 * 0.256)
    with pytest.raises(ValueError, match="2 layer ranges for 3 stages"):
        pipelined(LINEAR, 4096, 0, [0.0] * 3, [(0, 15), (15, 30)])
