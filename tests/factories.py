"""What the tests build again and again, built one way.

- `tiny_llama`: a random-weight Llama small enough to run on any CPU in milliseconds, for
  the engine's tests that need a real forward pass but not a real model's answers.
- `request`: a conductor-bound `GenerateRequest` with only what a test sets.

Waiting on a condition is `tests.waiting.until`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.engine.runner import LoadedModel
from shared.messages import GenerateRequest, SamplingParams
from shared.model_context import model_context


def tiny_llama(
    *,
    hidden: int = 96,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    layers: int = 2,
    intermediate: int = 128,
    vocab: int = 300,
    max_len: int = 512,
    rope_scaling: str = "",
) -> LoadedModel:
    """A random Llama (seed 0, fp32, CPU, no tokenizer): the same weights on every call.
    `rope_scaling` (e.g. "yarn:4") stretches its `max_len` trained positions, as
    `--rope-scaling` does a served model's."""
    fields = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_len,
    }
    ctx = model_context(fields, rope_scaling=rope_scaling)
    cfg = LlamaConfig(
        vocab_size=vocab,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        **{**fields, **ctx.overrides},
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return LoadedModel("tiny", model, None, torch.float32, "cpu", ctx.max_model_len, frozenset())


def request(
    rid: str,
    *,
    prompt: Sequence[int] = (1, 2, 3),
    max_tokens: int = 4,
    block_hashes: Sequence[int] = (),
) -> GenerateRequest:
    """A request as the gateway hands it to the conductor, arriving now."""
    return GenerateRequest(
        request_id=rid,
        model="m",
        prompt_token_ids=list(prompt),
        block_hashes=list(block_hashes),
        sampling=SamplingParams(max_tokens=max_tokens),
        arrival_time=time.time(),
    )
