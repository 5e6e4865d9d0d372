"""Speculative decoding by prompt lookup: the drafter finds what followed a recurring
suffix, greedy output is token for token the output without drafts, sampled output keeps
the model's distribution, and a draft never costs another sequence its blocks."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from shared.engine.block_manager import BlockManager
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.logits import RowContext
from shared.engine.params import Constraint, SamplingParams
from shared.engine.sampling import verify_drafts
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.sequence import Sequence
from shared.engine.speculative import NgramDrafter, SpeculativeConfig, accept_greedy, why_not
from tests.factories import tiny_llama

SPEC = SpeculativeConfig(num_speculative_tokens=4)


def _brute(tokens: list[int], limit: int, lo: int, hi: int) -> list[int]:
    """The same lookup by scanning the whole context, latest occurrence first."""
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + limit]
    return []


def test_the_drafter_proposes_what_followed_the_longest_recurring_suffix():
    d = NgramDrafter(SPEC)
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4]
    assert d.draft(tokens, 4) == [5, 9, 9, 2]  # "2 3 4" occurred at the start
    assert d.draft([*tokens, 7], 4) == []  # "4 7" never occurred before
    assert NgramDrafter(SPEC).draft(tokens, 2) == [5, 9]
    assert NgramDrafter(SPEC).draft(tokens, 0) == []


def test_the_drafters_index_grows_with_the_sequence_as_a_full_scan_finds():
    rng = random.Random(3)
    d = NgramDrafter(SPEC)
    tokens: list[int] = []
    for _ in range(600):
        tokens.append(rng.randrange(6))  # a small alphabet: many recurring n-grams
        assert d.draft(tokens, 4) == _brute(tokens, 4, 2, 4)


def test_greedy_keeps_the_drafts_the_model_would_have_chosen():
    assert accept_greedy([5, 6, 7], [5, 6, 8, 1]) == 2
    assert accept_greedy([5, 6], [4, 6, 1]) == 0
    assert accept_greedy([5, 6], [5, 6, 9]) == 2
    logits = torch.full((3, 10), -5.0)
    logits[0, 5] = logits[1, 2] = logits[2, 9] = 5.0
    row = RowContext(SamplingParams(temperature=0), 0)
    assert verify_drafts(logits, (5, 6), row) == [5, 2]  # 6 rejected: the model's 2
    logits[1, 6] = 9.0
    assert verify_drafts(logits, (5, 6), row) == [5, 6, 9]  # both kept, and its own 9


def test_sampled_drafts_keep_the_models_distribution():
    """A point-mass draft kept with probability p(draft), else a draw from the rest:
    the first token is distributed as p, whatever the draft."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(2, 1)
    row = RowContext(SamplingParams(temperature=1.0), 0)
    for draft in (1, 3):
        counts = torch.zeros(4)
        trials = 20_000
        for _ in range(trials):
            counts[verify_drafts(logits, (draft,), row)[0]] += 1
        assert torch.allclose(counts / trials, p, atol=0.015), (draft, counts / trials)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"repetition_penalty": 1.1}, "penalties"),
        ({"constraint": Constraint("json_object")}, "structured output"),
        ({"logprobs": 2}, "logprobs"),
        ({"logit_bias": ((5, 1.0),)}, "logit_bias"),
        ({"min_tokens": 3}, "min_tokens"),
        ({"temperature": 0.7, "top_p": 0.9, "seed": 4}, None),
    ],
)
def test_requests_whose_rows_need_their_history_are_not_drafted(change, why):
    assert why_not(replace(SamplingParams(), **change)) == why


@pytest.fixture(scope="module")
def lm():
    return tiny_llama()


def _prompt() -> list[int]:
    rng = random.Random(11)
    motif = [rng.randrange(1, 300) for _ in range(12)]
    return motif * 6 + [rng.randrange(1, 300) for _ in range(5)] + motif[:6]


def _generate(lm, spec: SpeculativeConfig, params: SamplingParams, prompts: list[list[int]]):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=8 << 20, speculative=spec))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_work():
        steps += 1
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.blocks.check_invariants()
    return [out[f"r{i}"] for i in range(len(prompts))], engine, steps


def test_greedy_output_is_the_output_without_drafts(lm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [_prompt(), list(range(1, 60)) * 2]
    plain, _, plain_steps = _generate(lm, SpeculativeConfig(), params, prompts)
    drafted, engine, steps = _generate(lm, SPEC, params, prompts)
    with torch.inference_mode():
        ref = lm.model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=40, do_sample=False, min_new_tokens=0
        )[0, len(prompts[0]) :].tolist()
    assert plain[0] == ref
    assert drafted == plain
    assert all(len(t) == 40 for t in drafted)
    # The check can fail: drafts were proposed and kept, and saved steps.
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert steps < plain_steps


def test_a_request_can_turn_drafts_off_and_max_tokens_cuts_a_kept_run(lm):
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    off = replace(params, num_speculative_tokens=0)
    plain, _, _ = _generate(lm, SpeculativeConfig(), params, [_prompt()])
    cut, engine, _ = _generate(lm, SPEC, params, [_prompt()])
    assert cut == plain and len(cut[0]) == 7
    _, engine, _ = _generate(lm, SPEC, off, [_prompt()])
    assert engine.stats().spec_draft_tokens == 0


def test_seeded_sampling_with_drafts_runs_the_same_twice(lm):
    params = SamplingParams(temperature=0.8, top_k=2, seed=5, max_tokens=30, ignore_eos=True)
    once, engine, _ = _generate(lm, SPEC, params, [_prompt()])
    again, _, _ = _generate(lm, SPEC, params, [_prompt()])
    assert once == again and len(once[0]) == 30
    assert engine.stats().spec_draft_tokens > 0


def test_a_draft_never_preempts_another_sequence():
    """Two decoding sequences in a pool with no block to spare: drafts are dropped, both
    still run one token each."""
    blocks = BlockManager(num_blocks=2, block_size=4)
    sched = Scheduler(SchedulerConfig(), blocks)
    seqs = []
    for rid in ("a", "b"):
        seq = Sequence(rid, [1, 2, 3, 4], 3, SamplingParams())
        assert blocks.allocate(seq, 3)
        seq.num_computed_tokens = 3
        seq.draft_token_ids = [5, 6]
        sched.add_running(seq)
        seqs.append(seq)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.draft) for s in out.scheduled] == [
        ("a", 1, ()),
        ("b", 1, ()),
    ]
    assert not out.preempted
