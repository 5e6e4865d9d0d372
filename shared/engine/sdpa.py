"""The torch path's chunk attention: SDPA of a chunk's queries against its sequence's KV
gathered from the pool, with the causal (and sliding-window) mask it needs, or split at
the chunk's start where that pays (split_attention.py). The native path reads the blocks
in place instead (csrc/prefill_attention.c); both compute the same attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine import split_attention
from shared.engine.batch import ChunkMeta
from shared.engine.kv_cache import KVCache


def needs_mask(chunk: ChunkMeta, window: int, device: torch.device) -> bool:
    """Whether SDPA of this chunk takes an explicit mask: one query sees every key, a
    chunk at 0 is plainly causal and one deep in its context runs split, unless a sliding
    window hides keys from some query."""
    total = chunk.pos0 + chunk.num_tokens
    if window and total > window:
        return True
    if not chunk.pos0 or chunk.num_tokens == 1:
        return False
    return not split_attention.pays(chunk.num_tokens, chunk.pos0, device)


def sdpa_chunk(
    kv: KVCache,
    layer: int,
    q: torch.Tensor,
    chunk: ChunkMeta,
    scale: float,
    mask: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """SDPA of a chunk's queries [n, Hq, D] against its sequence's gathered KV (the torch
    path; the native one reads the blocks in place, prefill_attention.c). `mask`: the
    chunk's causal_bias, if the caller keeps one (else it is built here); a chunk deep
    in its context runs split at pos0 instead (split_attention.py), with no mask.
    `window`: the layer's sliding window (0: none)."""
    total = chunk.pos0 + chunk.num_tokens
    k, v = kv.gather(layer, chunk.block_ids, total)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    masked = needs_mask(chunk, window, q.device)
    if not masked and split_attention.pays(chunk.num_tokens, chunk.pos0, q.device):
        o = split_attention.attention(qh, k.unsqueeze(0), v.unsqueeze(0), chunk.pos0, scale)
        return o[0].transpose(0, 1)
    causal = not masked and chunk.num_tokens > 1 and chunk.pos0 == 0
    if not masked:
        mask = None
    elif mask is None:
        mask = causal_bias(chunk.num_tokens, chunk.pos0, q.dtype, q.device, window)
    o = F.scaled_dot_product_attention(
        qh,
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def causal_bias(
    num_queries: int, pos0: int, dtype: torch.dtype, device: torch.device, window: int = 0
) -> torch.Tensor:
    """Query j (at position pos0 + j) sees keys 0 .. pos0 + j, or with a sliding window
    only the last `window` of them: 0 there, -inf elsewhere. Additive in the queries'
    dtype, as SDPA would turn a boolean mask into on every call (building and converting
    it was a tenth of a 256-token chunk's attention at 2k)."""
    keys = torch.arange(pos0 + num_queries, device=device)
    queries = torch.arange(pos0, pos0 + num_queries, device=device)
    hidden = keys.unsqueeze(0) > queries.unsqueeze(1)
    if window:
        hidden |= keys.unsqueeze(0) <= queries.unsqueeze(1) - window
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -torch.inf)
