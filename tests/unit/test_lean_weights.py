"""`--lean-weights`: the engine keeps each projection's weights once where its native
kernels take every row count, and releases transformers' copies as it packs them; the
output is what it was."""

from __future__ import annotations

import pytest
import torch

from shared.engine import kernels
from shared.engine.linear import DenseLinear, Int8Linear, gemm_fits
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from tests.factories import tiny_family, tiny_llama

PROMPTS = [[(5 * i + 1) % 300 for i in range(45)], [3, 1, 4, 1, 5]]


def greedy(lm, lean: bool, quantization: str = "none") -> list[list[int]]:
    cfg = EngineConfig(
        kv_cache_bytes=8 << 20,
        max_num_batched_tokens=32,
        lean_weights=lean,
        quantization=quantization,
    )
    engine = LLMEngine(lm, cfg)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


def projections(lm) -> list[torch.nn.Linear]:
    return [m for m in lm.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_lean_output_is_the_full_engine_s_and_transformers_copies_go(family, quantization):
    def fresh():
        return tiny_llama(hidden=128, heads=8) if family == "llama" else tiny_family(family)

    want = greedy(fresh(), lean=False, quantization=quantization)
    lm = fresh()
    assert greedy(lm, lean=True, quantization=quantization) == want
    assert all(p.weight.numel() == 0 for p in projections(lm))  # released


@pytest.mark.skipif(
    not (kernels.available() and gemm_fits(torch.zeros(32, 64, dtype=torch.bfloat16))),
    reason="no native bf16 GEMM on this CPU: lean keeps the row-major weights for MKL",
)
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_with_the_bf16_gemm_each_weight_is_held_once(quantization):
    lm = tiny_llama(hidden=128, heads=8, vocab=320)  # the head in panels too
    lm.model.to(torch.bfloat16)
    lm.dtype = torch.bfloat16
    cfg = EngineConfig(
        kv_cache_bytes=8 << 20,
        lean_weights=True,
        quantization=quantization,
        max_num_batched_tokens=64,
    )
    engine = LLMEngine(lm, cfg)
    linears = [lin for layer in engine.model.layers for lin in layer.linears]
    for lin in [*linears, engine.model.lm_head]:
        dense = lin.dense if isinstance(lin, Int8Linear) else lin
        assert isinstance(dense, DenseLinear) and dense.gemm
        assert dense.weight is None and dense.packed is None  # the GEMM's panels alone
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out: dict[str, list[int]] = {}
    # Alone, a prompt of five chunks: four steps that ask no logits (the head gets no
    # rows), then one; then a prompt of one chunk, and decode steps.
    for rid, prompt in (("long", [(3 * i + 2) % 300 for i in range(300)]), ("r", PROMPTS[0])):
        engine.add_request(rid, prompt, params)
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(out["r"]) == len(out["long"]) == 4


def test_engines_over_one_model_share_its_packed_layers_lean_or_not():
    """A prefill instance's engine and the pipeline stages it runs load one model: the
    stages reuse the engine's packed layers (after --lean-weights released transformers'
    copies, there is nothing else to pack from), and their output is unchanged."""
    from shared.engine.stage import StageRunner

    for lean in (False, True):
        lm = tiny_family("qwen3", layers=3)
        want = generate_ids(lm, PROMPTS[0])
        cfg = EngineConfig(kv_cache_bytes=8 << 20, lean_weights=lean)
        engine = LLMEngine(lm, cfg)
        first, last = StageRunner(lm, cfg, (0, 1)), StageRunner(lm, cfg, (1, 3))
        assert first.model.layers[0] is engine.model.layers[0]
        assert last.model.layers[1] is engine.model.layers[2]
        assert last.model.lm_head is engine.model.lm_head
        first.open("p", PROMPTS[0])
        last.open("p", PROMPTS[0])
        logits = last.run("p", len(PROMPTS[0]), first.run("p", len(PROMPTS[0])))
        assert int(logits[-1].argmax()) == want


def generate_ids(lm, prompt: list[int]) -> int:
    with torch.inference_mode():
        return int(lm.model(torch.tensor([prompt])).logits[0, -1].argmax())
