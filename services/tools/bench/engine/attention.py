"""Prefill attention on the model's shape: the native paged kernel (prefill_attention.c,
KV read in place) against the torch path (the sequence's KV gathered, then SDPA), one
chunk of queries at the end of a 2k and a 16k context, in GFLOP/s, same threads."""

from __future__ import annotations

import time
from typing import Any

import torch

from shared.engine import kernels
from shared.engine.batch import ChunkMeta
from shared.engine.kv_cache import KVCache, KVShape
from shared.engine.sdpa import sdpa_chunk

CONTEXTS = (2048, 16384)


def _best_s(fn: Any, reps: int) -> float:
    fn()  # warm: first touches, the kernels' build
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunk: int, reps: int = 3
) -> list[dict[str, Any]]:
    """One row per context: both paths' seconds and GFLOP/s."""
    return [_context(ctx, heads, kv_heads, head_dim, dtype, chunk, reps) for ctx in CONTEXTS]


def _context(
    ctx: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunk: int, reps: int
) -> dict[str, Any]:
    """A chunk of queries at the end of `ctx` tokens (causal: they see the context before
    them and half of the chunk, 4 FLOP per query, key and head dimension)."""
    n, block = min(chunk, ctx), 16
    blocks = ctx // block
    kv = KVCache(KVShape(1, kv_heads, head_dim, block, dtype), blocks)
    kv.k.normal_()
    kv.v.normal_()
    table = torch.randperm(blocks)  # blocks scattered in the pool, as they come
    q = torch.randn(n, heads * head_dim).to(dtype)
    out = torch.empty_like(q)
    meta = ChunkMeta(0, n, ctx - n, table)
    scale = head_dim**-0.5
    flops = 4.0 * n * (ctx - n / 2) * head_dim * heads
    torch_s = _best_s(lambda: sdpa_chunk(kv, 0, q.view(n, heads, head_dim), meta, scale), reps)
    row: dict[str, Any] = {"context": ctx, "chunk": n, "sdpa_s": torch_s}
    row["sdpa_gflops"] = flops / torch_s / 1e9
    if kernels.available():
        t32 = table.to(torch.int32)
        native_s = _best_s(
            lambda: kernels.paged_prefill_attention(q, kv.k[0], kv.v[0], t32, ctx - n, scale, out),
            reps,
        )
        row.update(native_s=native_s, native_gflops=flops / native_s / 1e9)
        row["native_over_sdpa"] = torch_s / native_s
    return row
