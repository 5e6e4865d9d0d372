"""The decode step's fused elementwise ops (csrc/ops.c), one call and one pass each.

Each replaces several eager torch ops with the same arithmetic, rounding included (see
the C comments): RMSNorm with the residual add, RoPE with the KV-cache write, SiLU-and-
mul. Callers check `kernels.available()` and keep the torch path otherwise.
"""

from __future__ import annotations

import torch

from shared.engine import kernels


def rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += delta (in place, if given); returns weight * normalize(h)."""
    rows, dim = h.shape
    out = torch.empty_like(h)
    kernels.lib().rms_norm(
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        kernels.is_bf16(h),
        kernels.threads(),
    )
    return out


def head_rms_norm(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> None:
    """RMSNorm of every q head (q_weight) and k head (k_weight) of each qkv row, in place:
    Qwen3's q_norm and k_norm, before RoPE."""
    assert qkv.stride(1) == 1 and q_weight.dtype == k_weight.dtype == qkv.dtype
    kernels.lib().head_rms_norm(
        qkv.data_ptr(),
        qkv.stride(0),
        qkv.shape[0],
        num_q_heads,
        num_kv_heads,
        head_dim,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        eps,
        kernels.is_bf16(qkv),
        kernels.threads(),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows laid out [gate | up]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    kernels.lib().silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        width // 2,
        kernels.is_bf16(gate_up),
        kernels.threads(),
    )
    return out


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotate q and k of every qkv row in place (cos/sin: fp32 tables indexed by position),
    then write each row's k and v into its (block, offset) slot of this layer's cache."""
    rows = qkv.shape[0]
    block_size = v_cache.shape[2]
    kernels.lib().rope_kv_write(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        rows,
        num_q_heads,
        num_kv_heads,
        head_dim,
        slot_blocks.data_ptr(),
        slot_offsets.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_size,
        kernels.is_bf16(qkv),
        kernels.threads(),
    )
