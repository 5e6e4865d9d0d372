"""What one step must at least cost: the larger of its FLOPs at the peak matmul rate and
its bytes (weights plus the KV it reads) at the measured bandwidth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.tools.bench.engine.machine import Limits


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, cfg: Any) -> ModelShape:
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            cfg.intermediate_size,
            cfg.vocab_size,
        )

    def linear_flops(self) -> float:
        """Matmul FLOPs of one token through every linear layer, lm_head included."""
        d, hd = self.hidden, self.head_dim
        per_layer = (
            d * (self.heads + 2 * self.kv_heads) * hd
            + self.heads * hd * d
            + 3 * d * self.intermediate
        )
        return 2.0 * (self.layers * per_layer + d * self.vocab)

    def attention_flops(self, context: float) -> float:
        return 2.0 * 2 * self.layers * self.heads * self.head_dim * context

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


def decode_step_bound(
    shape: ModelShape,
    contexts: list[int],
    weight_bytes: int,
    kv_itemsize: int,
    linear_peak: float,
    attn_peak: float,
    limits: Limits,
) -> dict[str, float]:
    """Seconds a decode step over sequences with these contexts cannot beat, and why."""
    flops_lin = len(contexts) * shape.linear_flops()
    flops_attn = sum(shape.attention_flops(c) for c in contexts)
    compute_s = flops_lin / linear_peak + flops_attn / attn_peak
    nbytes = weight_bytes + sum(contexts) * shape.kv_bytes_per_token(kv_itemsize)
    memory_s = nbytes / limits.bandwidth_bytes_s
    return {
        "bound_s": max(compute_s, memory_s),
        "compute_s": compute_s,
        "memory_s": memory_s,
        "bytes": float(nbytes),
        "flops": flops_lin + flops_attn,
    }
