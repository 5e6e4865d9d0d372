"""What the tests build again and again, built one way.

- `tiny_llama`: a random-weight Llama small enough to run on any CPU in milliseconds, for
  the engine's tests that need a real forward pass but not a real model's answers.
- `tiny_family`: the same for each supported family (Qwen2, Qwen3, Mistral, Phi-3), with
  the head geometry of its smallest published model and a few layers.
- `request`: a conductor-bound `GenerateRequest` with only what a test sets.

Waiting on a condition is `tests.waiting.until`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

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


# Each family's smallest published model's head geometry (query heads per KV head and
# head_dim), with fewer heads and layers: Qwen2.5-0.5B (14/2 heads of 64), Qwen3-0.6B
# (16/8 of 128, hidden 1024: not heads x head_dim), Mistral-7B-v0.1 (32/8 of 128, a
# 4,096-token sliding window), Phi-3-mini (32/32 of 96, fused checkpoints, a window).
FAMILY_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, object]]] = {
    "qwen2": (
        Qwen2Config,
        {"hidden_size": 448, "num_attention_heads": 7, "num_key_value_heads": 1},
    ),
    "qwen3": (
        Qwen3Config,
        {"hidden_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
    ),
    "mistral": (
        MistralConfig,
        {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128},
    ),
    "phi3": (Phi3Config, {"hidden_size": 384, "num_attention_heads": 4, "num_key_value_heads": 4}),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def tiny_family(
    family: str, *, layers: int = 2, vocab: int = 300, window: int = 0, max_len: int = 512
) -> LoadedModel:
    """A random model of `family` (seed 0, fp32, CPU, no tokenizer). `window`: a sliding
    window of that many tokens (Mistral and Phi-3 declare one; 0 leaves it out)."""
    config_class, geometry = FAMILY_CONFIGS[family]
    fields: dict[str, object] = {
        **geometry,
        "vocab_size": vocab,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "max_position_embeddings": max_len,
        # Wider than the default 0.02, so that greedy picks are clear of ties.
        "initializer_range": 0.05,
        "tie_word_embeddings": False,
    }
    if family == "phi3":
        fields.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = config_class(**fields)
    cfg.sliding_window = window or None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    return LoadedModel(family, model, None, torch.float32, "cpu", max_len, frozenset())


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
