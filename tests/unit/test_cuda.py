"""The engine on a CUDA device (the torch path: the native kernels are CPU-only), on a
random-weight Llama, against transformers' own forward on the same device. Skipped where
torch sees no CUDA device, which is every CI machine; docs/benchmarks.md records a run.

What it proves where a GPU is at hand:
- fp32 greedy tokens through the paged engine (chunked prefill, batched decode, a
  stretched RoPE) are transformers' tokens, as on the CPU;
- a pipelined prefill split into stages gives the whole model's logits;
- a reused prefix gives the cold run's tokens;
- a bf16 decode batch stays as close to transformers' bf16 forward as CPU bf16 does.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.engine.stage import StageRunner
from tests.factories import tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CHUNK = 40


def on_cuda(lm: LoadedModel, dtype: torch.dtype = torch.float32) -> LoadedModel:
    model = copy.deepcopy(lm.model).to(device="cuda", dtype=dtype)
    return replace(lm, model=model, dtype=dtype, device="cuda")


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    # TF32 would round fp32 matmuls to 10 mantissa bits in one path and not the other.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return on_cuda(tiny_llama(hidden=128, heads=8, layers=4))


def reference(lm: LoadedModel, prompt: list[int], n: int = 12) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(torch.tensor([ids], device="cuda")).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy(engine: LLMEngine, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def engine_for(lm: LoadedModel) -> LLMEngine:
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=8 << 20, max_num_batched_tokens=CHUNK))
    assert engine.kv.k.device.type == "cuda"  # the pool lives on the device
    return engine


def test_fp32_greedy_tokens_are_transformers_tokens_on_cuda(lm):
    prompts = [
        list(range(1, 30)),
        list(range(50, 170)),
        [7] * 3,
        [(5 * i) % 300 for i in range(77)],
    ]
    assert greedy(engine_for(lm), prompts) == [reference(lm, p) for p in prompts]


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_a_stretched_rope_runs_past_the_trained_positions_on_cuda(kind):
    lm = on_cuda(tiny_llama(max_len=64, rope_scaling=f"{kind}:4"))
    prompts = [[(7 * i) % 300 for i in range(150)]]
    assert greedy(engine_for(lm), prompts) == [reference(lm, p) for p in prompts]


def test_a_reused_prefix_gives_the_cold_runs_tokens_on_cuda(lm):
    engine = engine_for(lm)
    prompt = [(11 * i + 3) % 300 for i in range(100)]
    cold = greedy(engine, [prompt])
    warm = greedy(engine, [prompt])  # the first run's full blocks are cached by hash
    assert engine.blocks.cached_hashes(), "nothing was cached"
    assert warm == cold == [reference(lm, prompt)]


@pytest.mark.parametrize("split", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]], ids=len)
def test_pipelined_stages_give_the_whole_models_logits_on_cuda(lm, split):
    prompt = [(11 * i + 5) % 300 for i in range(150)]
    runners = [StageRunner(lm, EngineConfig(kv_cache_bytes=4 << 20), r) for r in split]
    for r in runners:
        assert r.open("p", prompt) == 0
    logits = None
    for pos in range(0, len(prompt), CHUNK):
        h = None
        for r in runners:
            h = r.run("p", min(CHUNK, len(prompt) - pos), h)
        logits = h
    assert logits is not None and logits.device.type == "cuda"
    with torch.inference_mode():
        ref = lm.model(torch.tensor([prompt], device="cuda")).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, rtol=0, atol=1e-4)


def last_logits(lm: LoadedModel, prompt: list[int]) -> torch.Tensor:
    """The prompt's last-token logits from the engine's forward, in chunks (a whole-model
    stage), as fp32."""
    runner = StageRunner(lm, EngineConfig(kv_cache_bytes=4 << 20), (0, lm.num_layers))
    runner.open("p", prompt)
    logits = None
    for pos in range(0, len(prompt), CHUNK):
        logits = runner.run("p", min(CHUNK, len(prompt) - pos))
    assert logits is not None
    return logits[0].float()


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16_is_on_cuda(lm):
    """bf16 rounds differently per kernel, so no exact match: the engine's bf16 logits
    must be about as close to the fp32 truth as transformers' own bf16 forward is."""
    bf = on_cuda(lm, torch.bfloat16)
    prompt = [(13 * i) % 300 for i in range(120)]
    with torch.inference_mode():
        truth = lm.model(torch.tensor([prompt], device="cuda")).logits[0, -1]
        theirs = bf.model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()

    def error(x: torch.Tensor) -> float:
        return ((x - truth).abs().mean() / truth.abs().mean()).item()

    assert error(last_logits(bf, prompt)) <= 2 * error(theirs) + 1e-3
    assert error(last_logits(lm, prompt)) < 1e-5
