"""A pool of KV blocks known by hash only (trace replay, the simulator), run on the
engines' own block pool: shared/engine/block_manager.py's BlockManager, so the figures
`halfmoon kv replay` and `halfmoon sim` report come from the eviction code that serves.

This adapter is bookkeeping too (no I/O, no clock: `now` comes in). It plays a request
as an engine does: hold each block of the chain (a cached one is a hit, a missing one a
fresh block, evicting the least recently freed block when none is empty), then release
them all. The release order is the eviction order:
- tail first (the engines' order, and the watermark policy's default): a chain's tail is
  evicted before its parents, which stay matchable;
- head first (plain LRU, docs/design.md's reference figures): exactly least recently used, a
  chain's blocks having been used in order.
A block of the chain is never evicted while the chain holds it, so a chain longer than
the pool is partly rejected. An unlimited pool (capacity None) grows instead of evicting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from shared.engine.block_manager import BlockManager, watermark_marks

POLICIES = ("lru", "watermark")
_GROW_BLOCKS = 4096  # an unlimited pool grows by at least this much at a time


@dataclass(slots=True)
class AdmitResult:
    """What one `admit` did. `rejected` is non-empty only when every block of the pool was
    held by the chain itself: the caller must not count on those blocks being cached."""

    inserted: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    num_touched: int = 0

    @property
    def exhausted(self) -> bool:
        return bool(self.rejected)


class HashPool:
    def __init__(
        self,
        capacity_blocks: int | None,
        policy: str = "lru",
        tail_first: bool | None = None,
        high_watermark: float = 0.90,
        evict_ratio: float = 0.05,
    ) -> None:
        """`tail_first=None` keeps the policy's default: off for plain LRU, on for watermark."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self.tail_first = policy == "watermark" if tail_first is None else tail_first
        self.high_watermark, self.evict_ratio = high_watermark, evict_ratio
        watermark_marks(capacity_blocks or 1, high_watermark, evict_ratio)  # ValueError early
        # Watermark eviction only has a mark to reach in a bounded pool.
        self._watermark = policy == "watermark" and capacity_blocks is not None
        self.blocks = BlockManager(capacity_blocks or _GROW_BLOCKS, block_size=1)

    # ---- queries ----------------------------------------------------------------------

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, int) and self.blocks.is_cached(block_hash)

    def __len__(self) -> int:
        return self.blocks.num_cached_blocks

    @property
    def num_evicted(self) -> int:
        return self.blocks.num_evictions

    def cached(self) -> list[int]:
        """The cached block hashes, in no particular order."""
        return self.blocks.cached_hashes()

    def prefix_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` cached here, stopping at the first miss."""
        return len(self.blocks.cached_chain(list(hashes)))

    # ---- mutations --------------------------------------------------------------------

    def admit(self, hashes: Sequence[int], now: float, replica: bool = False) -> AdmitResult:
        """Use a chain: its cached blocks are touched, the others inserted (as replicas,
        evicted first, when they are copies of a prefix held elsewhere)."""
        self.blocks.now = now
        result = AdmitResult()
        held: list[int] = []
        for h in hashes:
            block_id = self.blocks.take_cached(h)
            if block_id is not None:
                result.num_touched += 1
            elif result.rejected or (block_id := self._take_new(h)) is None:
                result.rejected.append(h)  # once full of this chain, it stays full
                continue
            else:
                result.inserted.append(h)
            held.append(block_id)
        self._release(held)
        if replica:
            self.blocks.mark_replicas(result.inserted)
        result.evicted = self.blocks.drain_events()[1]
        return result

    def touch(self, hashes: Iterable[int]) -> int:
        """Mark cached blocks as just used (e.g. read for a transfer); how many were cached."""
        held = [b for b in map(self.blocks.take_cached, hashes) if b is not None]
        self._release(held)
        return len(held)

    def _take_new(self, block_hash: int) -> int | None:
        if not self.blocks.num_empty_blocks:
            if self.capacity_blocks is None:
                self.blocks.add_blocks(max(_GROW_BLOCKS, self.blocks.num_blocks))
            elif self._watermark:
                # Full (the last batch was held back by a chain longer than the room under
                # the mark): make room with a batch, as a put into a full store does.
                self._evict_to_watermark()
        block_id = self.blocks.take_new(block_hash)
        if block_id is not None and self._watermark:
            self._evict_to_watermark()
        return block_id

    def _evict_to_watermark(self) -> None:
        self.blocks.evict_to_watermark(self.high_watermark, self.evict_ratio)

    def _release(self, held: list[int]) -> None:
        self.blocks.release(reversed(held) if self.tail_first else held)

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        if self.capacity_blocks is not None and self.blocks.num_blocks != self.capacity_blocks:
            raise RuntimeError(
                f"pool of {self.capacity_blocks} has {self.blocks.num_blocks} blocks"
            )
