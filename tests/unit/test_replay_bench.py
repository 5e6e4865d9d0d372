"""`halfmoon bench replay`'s pure parts: trace prompts keep prefix sharing in token space
(with the real tokenizer), slices keep whole conversations, and the summary's arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.kvmanager.traces import SAMPLE_TRACE, TraceRequest, load_trace
from services.tools.bench.client import Result
from services.tools.bench.replay.cluster import ClusterConfig
from services.tools.bench.replay.metrics import record_from
from services.tools.bench.replay.prompts import PromptMaker, ideal_hit_ratio, single_token_words
from services.tools.bench.replay.workload import SliceSpec, arrivals, select
from shared.run_summary import Slos, summarize


def tr(ts: int, hashes: list[int], inp: int | None = None, out: int = 512) -> TraceRequest:
    return TraceRequest(ts, inp if inp is not None else 512 * len(hashes), out, hashes)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def chat_ids(tok, content: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )["input_ids"]


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_hash_ids_become_exactly_shared_prompt_tokens(tokenizer):
    maker = PromptMaker(single_token_words(tokenizer), block_tokens=16)
    a = maker.make(tr(0, [7, 8, 9, 10]))
    b = maker.make(tr(0, [7, 8, 9, 11, 12]))
    c = maker.make(tr(0, [5, 8, 9, 10]))
    ia, ib, ic = (chat_ids(tokenizer, p.content) for p in (a, b, c))
    header = common(ia, ic)  # the chat template before the content
    assert len(ia) - len(chat_ids(tokenizer, "")) == a.input_tokens == 64  # one token a word
    assert common(ia, ib) == header + 3 * 16  # three shared blocks, to the token
    # deterministic: the same hash id is the same words in another maker with the same seed
    again = PromptMaker(single_token_words(tokenizer), block_tokens=16).make(tr(0, [7, 8, 9, 10]))
    assert again.content == a.content
    assert (
        PromptMaker(single_token_words(tokenizer), 16, seed=1).make(tr(0, [7, 8, 9, 10])).content
        != a.content
    )


def test_lengths_scale_and_cap():
    maker = PromptMaker(
        [f" w{i}" for i in range(100)],
        block_tokens=16,
        max_input_tokens=40,
        max_output_tokens=8,
        min_output_tokens=2,
    )
    p = maker.make(tr(0, [1, 2], inp=600, out=100))  # 600 trace tokens -> ceil(18.75) words
    assert (p.input_tokens, p.output_tokens, p.hash_ids) == (19, 4, (1, 2))
    assert maker.make(tr(0, [1, 2, 3, 4], out=10_000)).input_tokens == 40  # the cap
    assert maker.make(tr(0, [1], out=10_000)).output_tokens == 8
    assert maker.make(tr(0, [1], out=1)).output_tokens == 2


def test_ideal_hit_ratio_counts_leading_blocks_seen_before():
    maker = PromptMaker([f" w{i}" for i in range(100)], block_tokens=4)
    plans = [maker.make(tr(0, [1, 2])), maker.make(tr(0, [1, 2, 3])), maker.make(tr(0, [9, 2]))]
    # second request reuses blocks 1,2 (8 of 12 words); the third nothing (its root differs)
    assert ideal_hit_ratio(plans, 4) == pytest.approx(8 / (8 + 12 + 8))


def test_conversation_sampling_keeps_whole_conversations_and_the_reuse():
    trace = load_trace(str(SAMPLE_TRACE))  # 2% of the conversation trace's conversations
    # Sampling nests: the default 2% of the 2% sample is all of it, the requests the
    # default keeps from the full trace.
    assert select(trace, SliceSpec(sample_conversations=0.02)) == trace
    chosen = select(trace, SliceSpec(sample_conversations=0.01))
    roots = {tuple(r.hash_ids[:2]) for r in chosen}
    assert 50 < len(chosen) < len(trace)
    # every request of a kept conversation is kept
    assert sum(tuple(r.hash_ids[:2]) in roots for r in trace) == len(chosen)
    maker = PromptMaker([f" w{i}" for i in range(100)], block_tokens=16)
    assert ideal_hit_ratio([maker.make(r) for r in chosen], 16) > 0.3  # the trace's ~37%
    arr = arrivals(chosen, 0.1)
    assert arr[0] == 0 and arr == sorted(arr)
    assert arr[-1] == pytest.approx((chosen[-1].timestamp_ms - chosen[0].timestamp_ms) / 1e4)


def result(ttft: float, gaps: list[float], ok: bool = True, status: int = 200) -> Result:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return Result(
        ok=ok,
        status=status,
        ttft_s=ttft if ok else None,
        chunk_times=times if ok else [],
        completion_tokens=len(times),
        prompt_tokens=100,
        cached_tokens=40,
        end_s=times[-1] if ok else 0.1,
    )


def test_summary_tbt_goodput_and_capacity():
    gaps = [0.01] * 18 + [0.5, 0.3]  # 20 gaps: TBT = mean of the slowest 2 = 0.4
    recs = [
        record_from(0, 0.0, 0.0, 80, 21, result(0.2, gaps)),
        record_from(1, 1.0, 0.0, 80, 21, result(0.2, [0.05] * 20)),
        record_from(2, 2.0, 0.0, 80, 21, result(5.0, [0.05] * 20)),  # misses TTFT
        record_from(3, 3.0, 0.0, 80, 21, result(0, [], ok=False, status=429)),
    ]
    assert recs[0].tbt_s == pytest.approx(0.4) and recs[0].tpot_s == pytest.approx(sum(gaps) / 20)
    assert recs[3].status == "rejected"
    s = summarize(recs, 10.0, Slos(1.0, 0.3, (0.1, 0.5)), ideal_hit_ratio=0.5)
    assert (s["requests"], s["completed"], s["rejected"], s["failed"]) == (4, 3, 1, 0)
    assert s["goodput_rps"] == pytest.approx(0.1) and s["slo_attainment"] == 0.25
    assert s["effective_capacity_by_tbt_ms"] == {"100": 0.25, "500": 0.5}
    assert s["cache_hit_ratio"] == pytest.approx(0.4)
    assert s["ttft"]["p50_ms"] == pytest.approx(200.0)


def test_cluster_config_parses_flags_and_env():
    c = ClusterConfig.parse("ll=--prefill 2 --policy least_loaded HALFMOON_BALANCING_THRESHOLD=inf")
    assert c.name == "ll" and c.flags == ("--prefill", "2", "--policy", "least_loaded")
    assert c.env == {"HALFMOON_BALANCING_THRESHOLD": "inf"}
    with pytest.raises(ValueError):
        ClusterConfig.parse("--prefill 2")
