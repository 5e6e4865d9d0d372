"""Chained prefix block hashes: the one implementation every process uses.

Only full blocks are hashed. Block i's hash covers block i-1's hash, so equal hashes
mean equal *prefixes*, not just equal blocks:

    h_0 = xxh3_64(root(salt) || tokens_0 || extra)       root = xxh3_64("halfmoon" || salt)
    h_i = xxh3_64(h_{i-1}    || tokens_i || extra)

A tenant's salt goes into the root, so two tenants never share (or can time) each
other's cache. Hashes are unsigned 64-bit ints; `to_signed` maps them into SQL BIGINT.
"""

from __future__ import annotations

from array import array
from typing import Iterable, NewType, Sequence

import xxhash

BlockHash = NewType("BlockHash", int)

# Changing the seed invalidates every stored block: bump it with the KV layout version.
HASH_SEED = 0x4A1F_300D


def root_hash(salt: str = "") -> BlockHash:
    """The parent of block 0: depends on the tenant's salt only."""
    return BlockHash(xxhash.xxh3_64_intdigest(b"halfmoon\x00" + salt.encode(), seed=HASH_SEED))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    # uint32 little-endian: vocabularies stay far below 2**32, and the layout is explicit.
    arr = array("I", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every platform we run on has 4-byte "I"
        raise RuntimeError("array('I') is not 32-bit on this platform")
    return arr.tobytes()


def hash_block(parent: int, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash."""
    h = xxhash.xxh3_64(seed=HASH_SEED)
    h.update(parent.to_bytes(8, "little"))
    h.update(_token_bytes(tokens))
    if extra:
        h.update(extra)
    return BlockHash(h.intdigest())


def block_hashes(
    tokens: Sequence[int], block_size: int, salt: str = "", extra: bytes = b""
) -> list[BlockHash]:
    """Chained hashes of every *full* block of `tokens` (a trailing partial block is skipped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent: int = root_hash(salt)
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], extra)
        out.append(parent)
    return out


def to_signed(h: int) -> int:
    """Map an unsigned 64-bit hash into the signed range of SQL BIGINT (a bijection)."""
    return h - (1 << 64) if h >= (1 << 63) else h


def from_signed(v: int) -> BlockHash:
    return BlockHash(v + (1 << 64) if v < 0 else v)


def common_prefix_blocks(a: Iterable[int], b: Iterable[int]) -> int:
    """Number of leading hashes two chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
