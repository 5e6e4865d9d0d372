"""transformers baselines for `halfmoon bench engine`, measured in the same run."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from shared.engine.runner import LoadedModel


class _StepClock(LogitsProcessor):
    """Timestamps every generation step: the first marks the end of prefill."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def _generate(lm: LoadedModel, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(wall seconds, decode seconds) of one padded generate call."""
    width = max(len(p) for p in batch)
    # LoadedModel types its model and tokenizer loosely (any torch module, any tokenizer).
    tok: Any = lm.tokenizer
    model: Any = lm.model
    pad = tok.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=lm.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=lm.device)
    clock = _StepClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            logits_processor=LogitsProcessorList([clock]),
        )
    wall = time.perf_counter() - t0
    return wall, clock.stamps[-1] - clock.stamps[0]


def generate_batch1(lm: LoadedModel, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    wall = decode = 0.0
    for p in prompts:
        w, d = _generate(lm, [p], new_tokens)
        wall, decode = wall + w, decode + d
    n = len(prompts)
    return {
        "requests": n,
        "end_to_end_tok_s": n * new_tokens / wall,
        "decode_tok_s": n * (new_tokens - 1) / decode,
    }


def generate_padded(
    lm: LoadedModel, prompts: list[list[int]], new_tokens: int, batch: int
) -> dict[str, Any]:
    wall = decode = 0.0
    for i in range(0, len(prompts), batch):
        w, d = _generate(lm, prompts[i : i + batch], new_tokens)
        wall, decode = wall + w, decode + d
    n = len(prompts)
    return {
        "requests": n,
        "batch": batch,
        "end_to_end_tok_s": n * new_tokens / wall,
        "decode_tok_s": n * (new_tokens - 1) / decode,
    }


def peak_matmul_gflops(dtype: torch.dtype, device: str) -> float:
    """Best of a few large square matmuls in the run's dtype: the machine's ceiling."""
    n = 2048
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9
