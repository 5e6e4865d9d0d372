"""A sequence's KV by block, as contiguous bytes plus metadata, and back into a pool.

The bytes are the pool's own block layout (see kv_cache.py), so export and import are
one gather and one scatter. The metadata names everything a receiver must match
(model, dtype, layers, heads, block size, layout) so a mismatch is refused, not
silently computed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from pydantic import BaseModel

from shared.engine.block_manager import BlockManager
from shared.engine.kv_cache import KVCache
from shared.engine.sequence import Sequence

LAYOUT = "halfmoon-paged-v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVMeta(BaseModel):
    model: str
    dtype: str
    # The weights' quantization: KV computed by int8 weights differs from bf16's, so
    # instances that differ must not reuse each other's blocks.
    quantization: str = "none"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens: int
    num_blocks: int
    block_hashes: list[int] = []
    layout: str = LAYOUT


@dataclass
class KVExport:
    meta: KVMeta
    data: torch.Tensor  # 1-D, contiguous, on CPU

    def payload(self) -> memoryview:
        return memoryview(self.data.view(torch.uint8).numpy()).cast("B")

    @classmethod
    def from_bytes(cls, meta: KVMeta, payload: bytes | bytearray | memoryview) -> KVExport:
        buf = bytearray(payload) if isinstance(payload, bytes) else payload
        data = torch.frombuffer(buf, dtype=torch.uint8).view(DTYPES[meta.dtype])
        return cls(meta, data)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, dt in DTYPES.items() if dt == dtype)


def export_sequence(
    kv: KVCache, blocks: BlockManager, seq: Sequence, model: str, quantization: str = "none"
) -> KVExport:
    """The KV of `seq`'s computed tokens (its blocks are read now; callers may free them after)."""
    n_tokens = seq.num_computed_tokens
    n_blocks = -(-n_tokens // blocks.block_size)
    s = kv.shape
    meta = KVMeta(
        model=model,
        dtype=_dtype_name(s.dtype),
        quantization=quantization,
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_size=s.block_size,
        num_tokens=n_tokens,
        num_blocks=n_blocks,
        block_hashes=list(seq.block_hashes),
    )
    return KVExport(meta, kv.export_blocks(seq.block_table[:n_blocks]))


def export_cached(
    kv: KVCache, blocks: BlockManager, hashes: list[int], model: str, quantization: str = "none"
) -> KVExport | None:
    """The cached blocks of the longest leading run of `hashes` (for another instance)."""
    block_ids = blocks.cached_chain(hashes)
    if not block_ids:
        return None
    n, s = len(block_ids), kv.shape
    meta = KVMeta(
        model=model,
        dtype=_dtype_name(s.dtype),
        quantization=quantization,
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_size=s.block_size,
        num_tokens=n * s.block_size,
        num_blocks=n,
        block_hashes=list(hashes[:n]),
    )
    return KVExport(meta, kv.export_blocks(block_ids))


def check_compatible(meta: KVMeta, kv: KVCache, model: str, quantization: str = "none") -> None:
    s = kv.shape
    mine = {
        "model": model,
        "dtype": _dtype_name(s.dtype),
        "quantization": quantization,
        "num_layers": s.num_layers,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "block_size": s.block_size,
        "layout": LAYOUT,
    }
    theirs = {key: getattr(meta, key) for key in mine}
    differ = [
        f"{key} {theirs[key]!r} (here {mine[key]!r})" for key in mine if mine[key] != theirs[key]
    ]
    if differ:
        raise ValueError("KV from an incompatible instance: " + ", ".join(differ))
    if meta.num_blocks != -(-meta.num_tokens // meta.block_size):
        raise ValueError("KV metadata: block count does not cover the token count")


def import_sequence(
    kv: KVCache,
    blocks: BlockManager,
    seq: Sequence,
    export: KVExport,
    on_allocate: Callable[[], None] | None = None,
) -> bool:
    """Place `export` into freshly allocated blocks of `seq`; False if the pool is short."""
    if export.meta.num_tokens > seq.num_tokens:
        raise ValueError("KV covers more tokens than the sequence has")
    if not blocks.allocate(seq, export.meta.num_tokens):
        return False
    if on_allocate is not None:
        on_allocate()  # e.g. spill what the allocation evicted, before it is overwritten
    fill_sequence(kv, blocks, seq, export)
    return True


def fill_sequence(kv: KVCache, blocks: BlockManager, seq: Sequence, export: KVExport) -> None:
    """Write `export` into the blocks `seq` already holds (allocated, or reserved before
    the transfer started) and register them in the prefix cache."""
    meta = export.meta
    expected = meta.num_blocks * kv.shape.block_nbytes // kv.shape.dtype.itemsize
    if export.data.numel() != expected:
        raise ValueError(f"KV payload has {export.data.numel()} values, metadata says {expected}")
    if meta.num_tokens > seq.num_tokens or meta.num_blocks > len(seq.block_table):
        raise ValueError("KV covers more tokens than the sequence holds blocks for")
    # Blocks matched in this pool's prefix cache (a sibling sample's, say) are kept as
    # they are, and must be the very blocks the export names.
    cached = len(seq.block_hashes)
    if seq.block_hashes != list(meta.block_hashes[:cached]):
        raise ValueError("the pool's cached prefix blocks are not the exported ones")
    kv.import_blocks(seq.block_table[cached : meta.num_blocks], export.data, skip=cached)
    seq.num_computed_tokens = meta.num_tokens
    blocks.commit(seq)  # the imported prompt is now this instance's prefix cache too
