"""The part of a transformers Llama-family model the engine reads, as Protocols.

transformers types `model.config` and submodules loosely (`Tensor | Module` for any
attribute of an nn.Module), so the engine states what it relies on here and casts once
where a loaded model comes in (`causal_lm`).
"""

from __future__ import annotations

from typing import Protocol, Sequence, cast

import torch


class HFConfig(Protocol):
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int


class HFNorm(Protocol):
    """RMSNorm: a learned scale."""

    weight: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class HFRotary(Protocol):
    """The rotary embedding: cos and sin [batch, positions, head_dim] for position ids."""

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class HFAttention(Protocol):
    q_proj: torch.nn.Linear
    k_proj: torch.nn.Linear
    v_proj: torch.nn.Linear
    o_proj: torch.nn.Linear


class HFMLP(Protocol):
    gate_proj: torch.nn.Linear
    up_proj: torch.nn.Linear
    down_proj: torch.nn.Linear


class HFDecoderLayer(Protocol):
    self_attn: HFAttention
    mlp: HFMLP
    input_layernorm: HFNorm
    post_attention_layernorm: HFNorm


class HFBase(Protocol):
    embed_tokens: torch.nn.Embedding
    norm: HFNorm
    rotary_emb: HFRotary
    layers: Sequence[HFDecoderLayer]


class HFCausalLM(Protocol):
    config: HFConfig
    model: HFBase
    lm_head: torch.nn.Linear


def causal_lm(model: torch.nn.Module) -> HFCausalLM:
    """A loaded Llama-family model, seen through what the engine reads of it."""
    return cast(HFCausalLM, model)
