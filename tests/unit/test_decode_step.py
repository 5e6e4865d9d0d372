"""The one-call native decode step (decode_step.c) against the per-layer native path it
replaces: the same tokens, and it takes the rows the per-layer path sends to each kernel."""

from __future__ import annotations

import pytest
import torch

from shared.engine import kernels
from shared.engine.decode_step import NativeDecodeStep
from shared.engine.linear import gemm_fits
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from tests.factories import tiny_llama

ROWS = 12  # over the int8 GEMV's row limit in bf16 (6), under every GEMM's


def greedy(one_call: bool) -> list[list[int]]:
    lm = tiny_llama(hidden=128, heads=8, vocab=320)
    lm.model.to(torch.bfloat16)
    lm.dtype = torch.bfloat16
    cfg = EngineConfig(kv_cache_bytes=8 << 20, quantization="int8", max_num_batched_tokens=512)
    engine = LLMEngine(lm, cfg)
    if not one_call:
        engine.model._step = False  # the per-layer path for every step
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(ROWS):
        engine.add_request(f"r{i}", [(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)], params)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(ROWS)]


@pytest.mark.skipif(
    not (kernels.available() and gemm_fits(torch.zeros(32, 64, dtype=torch.bfloat16))),
    reason="no native bf16 GEMM on this CPU: int8 rows past the GEMV go to oneDNN",
)
def test_int8_decode_past_the_gemv_rows_runs_in_one_call_and_matches(monkeypatch):
    """Past the int8 GEMV's rows, Int8Linear multiplies its dequantized weights in the bf16
    GEMM; the one-call step must do the same, not fall back to a call per kernel."""
    calls: list[int] = []
    real = NativeDecodeStep.__call__

    def spy(self, h, positions, meta):
        calls.append(h.shape[0])
        return real(self, h, positions, meta)

    monkeypatch.setattr(NativeDecodeStep, "__call__", spy)
    want = greedy(one_call=False)
    assert not calls
    got = greedy(one_call=True)
    assert max(calls) == ROWS  # the full batch's decode steps went through the one call
    assert got == want
