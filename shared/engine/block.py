"""One KV block's bookkeeping (block_manager.py and partial_blocks.py keep them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept for verifying a hash hit
    hits: int = 0  # prefix-cache hits since the block was cached
    pinned_until: float = 0.0  # soft pin: evicted only when nothing unpinned is left
    parent_hash: int | None = None  # the chain before it (cached full blocks)
    replica: bool = False  # a copy of a prefix another instance holds: evicted first
