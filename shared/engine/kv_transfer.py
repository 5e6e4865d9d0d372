"""A sequence's KV by block, as contiguous bytes plus metadata, and back into a pool.

The bytes are the pool's own block layout (see kv_cache.py), so export and import are
one gather and one scatter. An export may cover a range of a sequence's blocks, not only
its start: a streamed handoff sends a long prompt's blocks chunk by chunk while prefill
computes the rest, and the last export carries what is left. The metadata names
everything a receiver must match (model, architecture, dtype, layers, heads, block size,
layout) so a mismatch is refused, not silently computed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from pydantic import BaseModel

from shared.engine.block_manager import BlockManager
from shared.engine.kv_cache import KVCache
from shared.engine.kv_slices import SliceProgress
from shared.engine.sequence import Sequence

LAYOUT = "halfmoon-paged-v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVMeta(BaseModel):
    model: str
    architecture: str = "LlamaForCausalLM"  # the model's class (architectures.py)
    dtype: str
    # The weights' quantization: KV computed by int8 weights differs from bf16's, so
    # instances that differ must not reuse each other's blocks.
    quantization: str = "none"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens: int  # the sequence's tokens covered from position 0 to this export's end
    num_blocks: int  # blocks in this export: first_block .. first_block + num_blocks - 1
    block_hashes: list[int] = []  # of this export's full blocks
    layout: str = LAYOUT
    first_block: int = 0
    # A pipeline stage's slice: layers first_layer .. first_layer + num_layers of each
    # block (a whole export: 0 and all of them).
    first_layer: int = 0


@dataclass
class KVExport:
    meta: KVMeta
    data: torch.Tensor  # 1-D, contiguous, on CPU

    def payload(self) -> memoryview:
        return self.data.view(torch.uint8).numpy().data.cast("B")  # the tensor's own bytes

    @classmethod
    def from_bytes(cls, meta: KVMeta, payload: bytes | bytearray | memoryview) -> KVExport:
        buf = bytearray(payload) if isinstance(payload, bytes) else payload
        data = torch.frombuffer(buf, dtype=torch.uint8).view(DTYPES[meta.dtype])
        return cls(meta, data)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, dt in DTYPES.items() if dt == dtype)


def _meta(
    kv: KVCache,
    model: str,
    quantization: str,
    num_tokens: int,
    first_block: int,
    hashes: list[int],
    num_blocks: int,
) -> KVMeta:
    s = kv.shape
    return KVMeta(
        model=model,
        architecture=s.architecture,
        dtype=_dtype_name(s.dtype),
        quantization=quantization,
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_size=s.block_size,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_hashes=hashes,
        first_block=first_block,
        first_layer=s.first_layer,
    )


def export_sequence(
    kv: KVCache,
    blocks: BlockManager,
    seq: Sequence,
    model: str,
    quantization: str = "none",
    first_block: int = 0,
) -> KVExport:
    """The KV of `seq`'s computed tokens from block `first_block` on (the ones before went
    ahead in a stream); its blocks are read now, so callers may free them after."""
    n_tokens = seq.num_computed_tokens
    n_blocks = -(-n_tokens // blocks.block_size)
    first = min(first_block, n_blocks)
    meta = _meta(
        kv, model, quantization, n_tokens, first, seq.block_hashes[first:], n_blocks - first
    )
    return KVExport(meta, kv.export_blocks(seq.block_table[first:n_blocks]))


def export_full_blocks(
    kv: KVCache, seq: Sequence, first_block: int, model: str, quantization: str = "none"
) -> KVExport | None:
    """The full (hashed) blocks of `seq` from `first_block` on, of a prompt still being
    computed: a streamed handoff's next chunk. None when there is none yet. Hashed blocks
    are complete and never written again, so the forward pass may run meanwhile."""
    full = len(seq.block_hashes)
    if full <= first_block:
        return None
    meta = _meta(
        kv,
        model,
        quantization,
        full * kv.shape.block_size,
        first_block,
        seq.block_hashes[first_block:full],
        full - first_block,
    )
    return KVExport(meta, kv.export_blocks(seq.block_table[first_block:full]))


def skip_blocks(export: KVExport, n: int) -> KVExport:
    """`export` without its first `n` blocks: ones the receiver has in place already (a
    streamed chunk acked after this export was read)."""
    m = export.meta
    if not 0 <= n <= m.num_blocks:
        raise ValueError(f"cannot skip {n} of {m.num_blocks} blocks")
    if n == 0:
        return export
    # export_blocks' layout: [K|V, layers, blocks, the block's values]
    data = export.data.view(2, m.num_layers, m.num_blocks, -1)[:, :, n:].contiguous().view(-1)
    meta = m.model_copy(
        update={
            "first_block": m.first_block + n,
            "num_blocks": m.num_blocks - n,
            "block_hashes": m.block_hashes[n:],
        }
    )
    return KVExport(meta, data)


def export_cached(
    kv: KVCache, blocks: BlockManager, hashes: list[int], model: str, quantization: str = "none"
) -> KVExport | None:
    """The cached blocks of the longest leading run of `hashes` (for another instance)."""
    block_ids = blocks.cached_chain(hashes)
    if not block_ids:
        return None
    n = len(block_ids)
    meta = _meta(kv, model, quantization, n * kv.shape.block_size, 0, list(hashes[:n]), n)
    return KVExport(meta, kv.export_blocks(block_ids))


def check_compatible(
    meta: KVMeta, kv: KVCache, model: str, quantization: str = "none", slice_ok: bool = False
) -> None:
    """ValueError unless `meta`'s KV fits this pool: the same model, dtype, quantization,
    heads, block size and layout, and every layer of it (or, with `slice_ok`, a range of
    its layers: a pipeline stage's slice)."""
    s = kv.shape
    mine: dict[str, object] = {
        "model": model,
        "architecture": s.architecture,
        "dtype": _dtype_name(s.dtype),
        "quantization": quantization,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "block_size": s.block_size,
        "layout": LAYOUT,
    }
    if not slice_ok:
        mine.update(num_layers=s.num_layers, first_layer=s.first_layer)
    else:
        lo, hi = meta.first_layer, meta.first_layer + meta.num_layers
        if not s.first_layer <= lo < hi <= s.first_layer + s.num_layers:
            raise ValueError(
                f"KV of layers {lo}..{hi} is not within this pool's "
                f"{s.first_layer}..{s.first_layer + s.num_layers}"
            )
    theirs = {key: getattr(meta, key) for key in mine}
    differ = [
        f"{key} {theirs[key]!r} (here {mine[key]!r})" for key in mine if mine[key] != theirs[key]
    ]
    if differ:
        raise ValueError("KV from an incompatible instance: " + ", ".join(differ))
    if meta.first_block < 0 or meta.first_block + meta.num_blocks != -(
        -meta.num_tokens // meta.block_size
    ):
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
    the transfer started) and register them in the prefix cache.

    The export may start past block 0 (a stream's later chunk, or its tail), but never past
    the blocks `seq` has in place: a gap would leave KV nobody computed. Blocks it already
    has (cached here, or from an earlier chunk) are kept as they are, and where they are
    hashed they must be the very blocks the export names."""
    meta = export.meta
    expected = meta.num_blocks * kv.shape.block_nbytes // kv.shape.dtype.itemsize
    if export.data.numel() != expected:
        raise ValueError(f"KV payload has {export.data.numel()} values, metadata says {expected}")
    first, end = meta.first_block, meta.first_block + meta.num_blocks
    if meta.num_tokens > seq.num_tokens or end > len(seq.block_table):
        raise ValueError("KV covers more tokens than the sequence holds blocks for")
    have = seq.num_computed_tokens // kv.shape.block_size
    if first > have:
        raise ValueError(f"KV starts at block {first} but only {have} are in place: a gap")
    hashed = seq.block_hashes[first:end]
    if hashed != list(meta.block_hashes[: len(hashed)]):
        raise ValueError("the pool's cached prefix blocks are not the exported ones")
    if have < end:
        kv.import_blocks(seq.block_table[have:end], export.data, skip=have - first)
    seq.num_computed_tokens = max(seq.num_computed_tokens, meta.num_tokens)
    blocks.commit(seq)  # the imported prompt is now this instance's prefix cache too


def fill_slice(
    kv: KVCache, blocks: BlockManager, seq: Sequence, export: KVExport, progress: SliceProgress
) -> int:
    """Write a stage's slice of `seq`'s KV (some layers of some blocks) into the blocks it
    holds; once every layer of a leading block is in place the sequence has computed it,
    and its full blocks join the prefix cache. Returns the whole leading blocks. Blocks
    this pool had cached already are kept as they are (their hashes must match)."""
    meta, s = export.meta, kv.shape
    per_block = 2 * meta.num_layers * s.num_kv_heads * s.head_dim * s.block_size
    if export.data.numel() != meta.num_blocks * per_block:
        raise ValueError(
            f"KV payload has {export.data.numel()} values, metadata says "
            f"{meta.num_blocks * per_block}"
        )
    first, end = meta.first_block, meta.first_block + meta.num_blocks
    if meta.num_tokens > seq.num_tokens or end > len(seq.block_table):
        raise ValueError("KV covers more tokens than the sequence holds blocks for")
    cached = len(seq.block_hashes)  # leading blocks this pool had (match_prefix)
    progress.mark_whole(cached)
    hashed = seq.block_hashes[first:end]
    if hashed != list(meta.block_hashes[: len(hashed)]):
        raise ValueError("the pool's cached prefix blocks are not the exported ones")
    start = max(first, cached)
    layers = (meta.first_layer - s.first_layer, meta.first_layer - s.first_layer + meta.num_layers)
    if start < end:
        kv.import_blocks(seq.block_table[start:end], export.data, skip=start - first, layers=layers)
    progress.add(first, meta.num_blocks, layers[0], meta.num_layers, meta.num_tokens)
    seq.num_computed_tokens = max(seq.num_computed_tokens, progress.covered_tokens(s.block_size))
    blocks.commit(seq)
    return progress.whole_blocks
