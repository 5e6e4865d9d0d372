"""Past 16k tokens on a small random-weight Llama with 32k positions: the paged engine's
chunked prefill and decode give transformers' own greedy tokens, on the native path and the
torch one (issue 29's exactness at long context, without a long model download)."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine import kernels
from shared.engine.batch import build_batch
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence
from tests.factories import tiny_llama

NEW_TOKENS = 8
CHUNK = 4096


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(max_len=32768)


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(29)
    return [rng.randrange(1, 300) for _ in range(16_500)]


@pytest.fixture(scope="module")
def reference(lm, prompt):
    with torch.inference_mode():
        out = lm.model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def last_logits(lm, prompt):
    """transformers' logits at the prompt's last position, and those it gives when only
    the last 4,000 tokens are there (what losing the early context would look like)."""
    with torch.inference_mode():
        whole = lm.model(torch.tensor([prompt])).logits[0, -1]
        cut = lm.model(torch.tensor([prompt[-4000:]])).logits[0, -1]
    return whole, cut


@pytest.mark.parametrize("native", [False, True])
def test_the_last_chunks_logits_are_transformers_within_1e_4(lm, prompt, last_logits, native):
    if native and not kernels.available():
        pytest.skip("no C compiler: the native kernels are not built")
    whole, cut = last_logits
    # The check can fail: this random model's answer barely depends on far context, but
    # its logits move by more than the tolerance without it.
    assert (whole - cut).abs().max() > 1e-3
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=16 << 20))
    engine.model.native = native
    seq = Sequence("s", list(prompt), len(prompt), SamplingParams(temperature=0))
    for start in range(0, len(prompt), CHUNK):
        n = min(CHUNK, len(prompt) - start)
        assert engine.blocks.allocate(seq, n)
        batch, _ = build_batch([ScheduledSeq(seq, n)], engine.config.block_size, "cpu")
        logits = engine.model.forward(batch)
        seq.num_computed_tokens += n
    torch.testing.assert_close(logits[0], whole, rtol=0, atol=1e-4)


@pytest.mark.parametrize("native", [False, True])
def test_a_16k_prompt_in_chunks_decodes_as_transformers_does(lm, prompt, reference, native):
    if native and not kernels.available():
        pytest.skip("no C compiler: the native kernels are not built")
    # 4,096-token chunks: the prompt takes five prefill steps, each attending to the KV
    # of those before it in the paged pool.
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=CHUNK))
    engine.model.native = native
    engine.add_request(
        "long", prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    tokens: list[int] = []
    steps = 0
    while engine.has_work():
        steps += 1
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert steps >= 5 + NEW_TOKENS - 1
    assert tokens == reference
