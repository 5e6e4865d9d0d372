"""The token-exact prompt cache: a finished sequence's partly filled last block is kept,
and a prompt that repeats (or extends) its tokens gets them copied instead of computed:
only its last token is computed again, and its output is the output computed cold."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.block_manager import BlockManager
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.sequence import SeqStatus, Sequence
from tests.factories import tiny_llama

BS = 4


def _finished(blocks: BlockManager, tokens: list[int], salt: str = "") -> Sequence:
    """A sequence whose every token has KV, then finished as the scheduler does it."""
    seq = Sequence("a", list(tokens), len(tokens), SamplingParams(), salt)
    blocks.match_prefix(seq)
    assert blocks.allocate(seq, len(tokens) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(tokens)
    blocks.commit(seq)
    blocks.keep_partial(seq)
    blocks.free(seq)
    return seq


def _admit(blocks: BlockManager, tokens: list[int], salt: str = "") -> tuple[Sequence, int]:
    seq = Sequence("b", list(tokens), len(tokens), SamplingParams(), salt)
    blocks.match_prefix(seq)
    return seq, blocks.match_partial(seq)


def test_a_repeated_prompt_reuses_the_partial_block_but_its_last_token():
    blocks = BlockManager(8, BS)
    _finished(blocks, [1, 2, 3, 4, 5, 6, 7])  # one full block, three tokens in the next
    seq, got = _admit(blocks, [1, 2, 3, 4, 5, 6, 7])
    assert got == 2 and seq.num_computed_tokens == 6 and seq.num_cached_tokens == 6
    [(src, dst)] = blocks.take_copies()
    assert dst == seq.block_table[-1] and src != dst
    assert blocks.blocks[src].ref_count == 1  # held until the engine has copied it
    blocks.release([src])
    blocks.check_invariants()
    assert blocks.take_copies() == []


@pytest.mark.parametrize(
    ("tokens", "salt", "want"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], "", 3),  # extends it: all three kept tokens
        ([1, 2, 3, 4, 5, 9, 7, 8], "", 1),  # parts after one token
        ([1, 2, 3, 4, 9, 6, 7], "", 0),  # nothing in common after the full block
        ([1, 2, 3, 4, 5, 6, 7], "tenant-b", 0),  # another tenant's chain
        ([1, 2, 3, 4, 5], "", 0),  # its only token after the block is its last
    ],
)
def test_only_the_tokens_that_agree_are_reused(tokens, salt, want):
    blocks = BlockManager(8, BS)
    _finished(blocks, [1, 2, 3, 4, 5, 6, 7])
    _, got = _admit(blocks, tokens, salt)
    assert got == want
    for src, _ in blocks.take_copies():
        blocks.release([src])
    blocks.check_invariants()


def test_a_kept_partial_block_is_evicted_like_a_cached_one():
    blocks = BlockManager(3, BS)
    _finished(blocks, [1, 2, 3, 4, 5, 6])
    assert blocks.num_empty_blocks == 1  # the full block and the partial one hold data
    other = Sequence("c", list(range(20, 32)), 12, SamplingParams())
    assert blocks.allocate(other, 12)  # every block: the cached ones are evicted
    blocks.check_invariants()
    blocks.free(other)
    _, got = _admit(blocks, [1, 2, 3, 4, 5, 6])
    assert got == 0


def test_a_waiting_sequence_keeps_nothing_and_a_running_one_does():
    blocks = BlockManager(8, BS)
    seq = Sequence("w", [1, 2, 3, 4, 5, 6], 6, SamplingParams())
    seq.status = SeqStatus.WAITING
    assert blocks.allocate(seq, 6)
    blocks.free(seq)  # never computed: the scheduler's finish keeps only running ones
    assert _admit(blocks, [1, 2, 3, 4, 5, 6])[1] == 0


@pytest.fixture(scope="module")
def lm():
    return tiny_llama()


def _run(engine: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
        engine.blocks.check_invariants()
    return out


def test_a_repeated_or_extended_prompt_computes_one_token_and_answers_the_same(lm):
    rng = random.Random(5)
    prompt = [rng.randrange(1, 300) for _ in range(45)]  # 2 full blocks and 13 tokens
    cold = LLMEngine(lm, EngineConfig(kv_cache_bytes=4 << 20))
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=4 << 20))
    first = _run(engine, "first", prompt)
    missed = engine.num_prefix_miss_tokens
    again = _run(engine, "again", prompt)
    assert again == first
    assert engine.num_prefix_miss_tokens - missed == 1  # only the last prompt token
    # The first request's output extended its prompt's last block; a prompt that quotes
    # the answer too reuses that block as far as it agrees.
    longer = prompt + first[:3]
    missed = engine.num_prefix_miss_tokens
    assert _run(engine, "longer", longer) == _run(cold, "cold", longer)
    assert engine.num_prefix_miss_tokens - missed == 1
    with torch.inference_mode():
        ref = lm.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert again == ref[0, len(prompt) :].tolist()
