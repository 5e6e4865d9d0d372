"""Which attention a prefill chunk runs (the paged kernel or SDPA) is chosen by the CPU,
the dtype and the chunk, and both give transformers' logits within 1e-4 (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shared.engine import attention_path, kernels, split_attention
from shared.engine.batch import build_batch
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sdpa import causal_bias
from shared.engine.sequence import Sequence
from tests.factories import tiny_llama

AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(
    ("dtype", "flags", "mode", "least"),
    [
        (torch.bfloat16, AMX, "auto", attention_path.SDPA_MIN_CHUNK),
        (torch.float32, AMX, "auto", None),  # no AMX for fp32: the kernel wins
        (torch.bfloat16, AVX512_BF16, "auto", None),  # bf16 dot products, no tiles
        (torch.float32, AVX2, "auto", None),
        (torch.bfloat16, AMX, "native", None),
        (torch.float32, AVX2, "sdpa", 1),
    ],
)
def test_sdpa_is_picked_for_bf16_chunks_on_amx_alone(dtype, flags, mode, least):
    assert attention_path.sdpa_min_chunk(dtype, flags, mode) == least


def test_the_env_forces_a_path_and_refuses_an_unknown_one(monkeypatch):
    monkeypatch.setenv(attention_path.ENV, "sdpa")
    assert attention_path.for_model(torch.float32) == 1
    assert attention_path.describe(torch.float32) == "SDPA"
    monkeypatch.setenv(attention_path.ENV, "Native")
    assert attention_path.for_model(torch.bfloat16) is None
    monkeypatch.setenv(attention_path.ENV, "amx")
    with pytest.raises(ValueError, match="HALFMOON_PREFILL_ATTENTION='amx'"):
        attention_path.requested()


def test_the_model_takes_the_rule_when_built(monkeypatch):
    monkeypatch.setenv(attention_path.ENV, "sdpa")
    engine = LLMEngine(tiny_llama(), EngineConfig(kv_cache_bytes=4 << 20))
    assert engine.model.sdpa_min_chunk == 1


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(max_len=2048)


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(7)
    return [rng.randrange(1, 300) for _ in range(1100)]


@pytest.fixture(scope="module")
def whole(lm, prompt):
    with torch.inference_mode():
        return lm.model(torch.tensor([prompt])).logits[0, -1]


# None: the paged kernel for every chunk; 1: SDPA for every chunk; 64: SDPA for the
# chunks of 512, 500 and 76 queries and the kernel for the last 12, so one prompt
# crosses from one path to the other over the same pool. Through SDPA, the chunk of 500
# runs with a mask and those of 76 and 12 (over 768 cached tokens) split at their start.
@pytest.mark.parametrize("least", [None, 1, 64])
def test_either_path_gives_transformers_logits_within_1e_4(lm, prompt, whole, least):
    if not kernels.available():
        pytest.skip("no C compiler: the native kernels are not built")
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=8 << 20))
    assert engine.model.native
    engine.model.sdpa_min_chunk = least
    seq = Sequence("s", list(prompt), len(prompt), SamplingParams(temperature=0))
    for n in (512, 500, 76, 12):
        assert engine.blocks.allocate(seq, n)
        batch, _ = build_batch([ScheduledSeq(seq, n)], engine.config.block_size, "cpu")
        logits = engine.model.forward(batch)
        seq.num_computed_tokens += n
    assert seq.num_computed_tokens == len(prompt)
    torch.testing.assert_close(logits[0], whole, rtol=0, atol=1e-4)


@pytest.mark.parametrize("queries, pos0", [(2, 768), (76, 1012), (256, 1792), (300, 2000)])
def test_split_attention_is_the_masked_attention(queries, pos0):
    assert split_attention.pays(queries, pos0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(queries)
    q = torch.randn(1, 9, queries, 64, generator=gen)
    k, v = (torch.randn(1, 3, pos0 + queries, 64, generator=gen) for _ in range(2))
    masked = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_bias(queries, pos0, q.dtype, q.device), enable_gqa=True
    )
    split = split_attention.attention(q, k, v, pos0, scale=64**-0.5)
    torch.testing.assert_close(split, masked, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "queries, pos0, split",
    [(256, 1792, True), (512, 1536, True), (512, 1024, False), (64, 512, False), (1, 4096, False)],
)
def test_a_chunk_runs_split_deep_in_its_context_alone(queries, pos0, split):
    assert split_attention.pays(queries, pos0, torch.device("cpu")) is split
    assert not split_attention.pays(queries, pos0, torch.device("meta"))
