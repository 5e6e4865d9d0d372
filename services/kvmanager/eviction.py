"""Eviction policies over a pool of C blocks: pure bookkeeping, no I/O, no clock.

Order is by a logical access tick (strict LRU order even when many accesses share a
`now`); `now` (seconds, from the caller) only decides whether a soft pin has expired.

Errors follow the project's rule: a full pool with nothing evictable is a return value
(`AdmitResult.rejected`), misuse (releasing an unleased block, ...) a ValueError, a broken
invariant a RuntimeError.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, NewType, Sequence

from shared.hashing import BlockHash

NumBlocks = NewType("NumBlocks", int)
Tick = NewType("Tick", int)


@dataclass(slots=True)
class AdmitResult:
    """What one `admit` call did. `rejected` is non-empty only when the pool was full and
    nothing in it could be evicted (leased, pinned, or part of this very chain): the
    caller must not count on those blocks being cached."""

    inserted: list[BlockHash] = field(default_factory=list)
    evicted: list[BlockHash] = field(default_factory=list)
    rejected: list[BlockHash] = field(default_factory=list)
    num_touched: int = 0

    @property
    def exhausted(self) -> bool:
        return bool(self.rejected)


class BlockPool(ABC):
    """Shared state of every policy: membership, access order, chain links, leases, pins.

    With `tail_first`, a block that is the parent of a still-cached block is not a
    candidate: evicting a chain's head first would strand every block after it (a prefix
    match stops at the first miss), so the tail goes first.
    """

    def __init__(self, capacity_blocks: int | None, tail_first: bool) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        self.capacity_blocks: NumBlocks | None = (
            None if capacity_blocks is None else NumBlocks(capacity_blocks)
        )
        self.tail_first = tail_first
        self.num_evicted = 0
        self._tick = Tick(0)
        self._call_tick = Tick(0)
        self._last: dict[BlockHash, Tick] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        # Cached blocks per parent hash, kept whether or not the parent itself is cached,
        # so a parent inserted after its orphaned children is still known to be no leaf.
        self._children: dict[BlockHash, int] = {}
        self._leases: dict[BlockHash, int] = {}
        self._pins: dict[BlockHash, float] = {}

    # ---- queries ------------------------------------------------------------------------

    def __contains__(self, block: object) -> bool:
        return block in self._last

    def __len__(self) -> int:
        return len(self._last)

    @property
    def num_blocks(self) -> NumBlocks:
        return NumBlocks(len(self._last))

    def blocks(self) -> list[BlockHash]:
        """Cached blocks, least recently used first."""
        return sorted(self._last, key=self._last.__getitem__)

    def prefix_blocks(self, hashes: Sequence[int]) -> NumBlocks:
        """Leading blocks of `hashes` cached here, stopping at the first miss."""
        n = 0
        for h in hashes:
            if h not in self._last:
                break
            n += 1
        return NumBlocks(n)

    def lease_count(self, block: int) -> int:
        return self._leases.get(BlockHash(block), 0)

    def is_pinned(self, block: int, now: float) -> bool:
        until = self._pins.get(BlockHash(block))
        return until is not None and now < until

    # ---- mutations ----------------------------------------------------------------------

    def admit(self, hashes: Sequence[int], now: float, parent_of: int | None = None) -> AdmitResult:
        """Touch the cached blocks of a chain and insert the others, evicting as the
        policy says. Block i's parent is block i-1, block 0's is `parent_of`.

        Blocks of this chain are never evicted by this same call (the caller is about to
        use them): a chain longer than the free room is partly rejected instead."""
        result = AdmitResult()
        self._call_tick = self._tick  # accesses after this tick belong to this call
        parent = None if parent_of is None else BlockHash(parent_of)
        for raw in hashes:
            h = BlockHash(raw)
            if h in self._last:
                self._access(h)
                result.num_touched += 1
            elif result.rejected or not self._make_room(now, result.evicted):
                result.rejected.append(h)  # once full and stuck, stay stuck for this call
            else:
                self._insert(h, parent)
                result.inserted.append(h)
                self._after_insert(now, result.evicted)
            parent = h
        return result

    def touch(self, hashes: Iterable[int]) -> int:
        """Mark cached blocks as just used. Returns how many were cached."""
        n = 0
        for h in hashes:
            if h in self._last:
                self._access(BlockHash(h))
                n += 1
        return n

    def remove(self, block: int, force: bool = False) -> bool:
        """Drop a block for a reason outside the policy (its holder lost it). A leased
        block is in use, so dropping it needs `force`. Returns whether it was cached."""
        h = BlockHash(block)
        if h not in self._last:
            return False
        if self._leases.get(h) and not force:
            raise ValueError(f"block {h} is leased ({self._leases[h]}); pass force=True")
        self._drop(h)
        return True

    def acquire(self, block: int) -> int:
        """Lease a cached block (e.g. while it is read or transferred): it cannot be
        evicted until every lease is released. Returns the new lease count."""
        h = BlockHash(block)
        if h not in self._last:
            raise ValueError(f"cannot lease block {h}: not cached")
        self._leases[h] = self._leases.get(h, 0) + 1
        return self._leases[h]

    def release(self, block: int) -> int:
        h = BlockHash(block)
        count = self._leases.get(h, 0)
        if count == 0:
            raise ValueError(f"cannot release block {h}: not leased")
        if count == 1:
            del self._leases[h]
        else:
            self._leases[h] = count - 1
        return count - 1

    def pin(self, block: int, now: float, ttl_s: float) -> None:
        """Soft pin: skipped by eviction until now + ttl_s. Pins only ever extend."""
        h = BlockHash(block)
        if h not in self._last:
            raise ValueError(f"cannot pin block {h}: not cached")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._pins[h] = max(self._pins.get(h, now), now + ttl_s)

    def unpin(self, block: int) -> bool:
        return self._pins.pop(BlockHash(block), None) is not None

    def check_invariants(self) -> None:
        """Raises RuntimeError if the bookkeeping disagrees with itself."""
        if self.capacity_blocks is not None and len(self._last) > self.capacity_blocks:
            raise RuntimeError(
                f"{len(self._last)} blocks cached over capacity {self.capacity_blocks}"
            )
        counted: dict[BlockHash, int] = {}
        for p in self._parent.values():
            if p is not None:
                counted[p] = counted.get(p, 0) + 1
        if counted != {p: n for p, n in self._children.items() if n}:
            raise RuntimeError("child counts drifted from parent links")
        if not set(self._leases) <= set(self._last) or not set(self._pins) <= set(self._last):
            raise RuntimeError("lease or pin on a block that is not cached")

    # ---- policy hooks -------------------------------------------------------------------

    @abstractmethod
    def _make_room(self, now: float, evicted: list[BlockHash]) -> bool:
        """Called before an insert; free a place if the pool is full. False = exhausted."""

    def _after_insert(self, now: float, evicted: list[BlockHash]) -> None:
        """Called after an insert (watermark policies evict here)."""

    def _on_access(self, h: BlockHash, tick: Tick) -> None:
        """Called whenever a block's access tick changes."""

    def _on_leaf(self, h: BlockHash) -> None:
        """Called when a cached block's last cached child leaves."""

    # ---- shared internals ---------------------------------------------------------------

    def _is_candidate(self, h: BlockHash, now: float) -> bool:
        if self._last[h] > self._call_tick:
            return False  # part of the chain being admitted
        if self.tail_first and self._children.get(h):
            return False
        if self._leases and h in self._leases:
            return False
        if self._pins and h in self._pins:
            if now < self._pins[h]:
                return False
            del self._pins[h]  # expired: forget it so the dict stays small
        return True

    def _access(self, h: BlockHash) -> None:
        self._tick = Tick(self._tick + 1)
        self._last[h] = self._tick
        self._on_access(h, self._tick)

    def _insert(self, h: BlockHash, parent: BlockHash | None) -> None:
        self._parent[h] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._access(h)

    def _drop(self, h: BlockHash) -> None:
        del self._last[h]
        self._leases.pop(h, None)
        self._pins.pop(h, None)
        parent = self._parent.pop(h)
        if parent is None:
            return
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
            return
        del self._children[parent]
        if parent in self._last:
            self._on_leaf(parent)

    def _evict(self, h: BlockHash, evicted: list[BlockHash]) -> None:
        self._drop(h)
        evicted.append(h)
        self.num_evicted += 1

    def _no_victim(self) -> bool:
        """Nothing evictable: fine if something is leased, pinned or part of the chain
        being admitted; otherwise some cached block must be a leaf, so this is a bug."""
        if self._last and not self._leases and not self._pins and self._tick == self._call_tick:
            raise RuntimeError(
                f"{len(self._last)} blocks cached, none leased or pinned, yet none evictable "
                "(parent links form a cycle?)"
            )
        return False


class LRUPolicy(BlockPool):
    """Plain LRU: a block leaves only when a new one needs its place.

    Victims come from a min-heap of (tick, hash) with lazy deletion: every access pushes
    an entry and stale ones are skipped on pop, so each eviction is O(log n) amortized.
    """

    def __init__(self, capacity_blocks: int | None, tail_first: bool = False) -> None:
        super().__init__(capacity_blocks, tail_first)
        self._heap: list[tuple[Tick, BlockHash]] = []

    def _make_room(self, now: float, evicted: list[BlockHash]) -> bool:
        if self.capacity_blocks is None or len(self._last) < self.capacity_blocks:
            return True
        victim = self._pop_victim(now)
        if victim is None:
            return self._no_victim()
        self._evict(victim, evicted)
        return True

    def _pop_victim(self, now: float) -> BlockHash | None:
        skipped: list[tuple[Tick, BlockHash]] = []  # leased/pinned: still candidates later
        victim = None
        while self._heap:
            tick, h = heapq.heappop(self._heap)
            if self._last.get(h) != tick:
                continue  # stale: touched again or gone since this entry was pushed
            if self.tail_first and self._children.get(h):
                continue  # pushed again by _on_leaf once its last child goes
            if tick > self._call_tick:  # this and every later entry: the chain being admitted
                skipped.append((tick, h))
                break
            if self._is_candidate(h, now):
                victim = h
                break
            skipped.append((tick, h))
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return victim

    def _on_access(self, h: BlockHash, tick: Tick) -> None:
        heapq.heappush(self._heap, (tick, h))
        # Stale entries pile up under a hot working set: rebuild once they dominate.
        if len(self._heap) > 4 * len(self._last) + 1024:
            self._heap = [(t, b) for b, t in self._last.items()]
            heapq.heapify(self._heap)

    def _on_leaf(self, h: BlockHash) -> None:
        heapq.heappush(self._heap, (self._last[h], h))


class WatermarkPolicy(BlockPool):
    """Mooncake Store's eviction: once usage reaches the high watermark, evict in one batch
    down to (high_watermark - evict_ratio) of capacity, oldest first, skipping leased and
    soft-pinned blocks and (by default) parents of cached blocks.

    It is approximate LRU in that a batch is picked at trigger time, so the pool runs
    between the two marks and holds fewer blocks on average than plain LRU.
    """

    def __init__(
        self,
        capacity_blocks: int | None,
        high_watermark: float = 0.90,
        evict_ratio: float = 0.05,
        tail_first: bool = True,
    ) -> None:
        super().__init__(capacity_blocks, tail_first)
        if not 0.0 < high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark}")
        if not 0.0 < evict_ratio <= high_watermark:
            raise ValueError(f"evict_ratio must be in (0, high_watermark], got {evict_ratio}")
        self.high_watermark = high_watermark
        self.evict_ratio = evict_ratio
        self.num_triggers = 0
        # The batch being evicted, so a parent freed mid-batch can join it (see _on_leaf).
        self._batch: list[tuple[Tick, BlockHash]] | None = None
        self._batch_now = 0.0
        cap = capacity_blocks or 0
        self._high_blocks = max(1, math.ceil(cap * high_watermark))
        # Evict at least one block, or a tiny pool would never make progress.
        low = math.floor(cap * (high_watermark - evict_ratio))
        self._low_blocks = min(self._high_blocks - 1, low)

    def _make_room(self, now: float, evicted: list[BlockHash]) -> bool:
        if self.capacity_blocks is None or len(self._last) < self.capacity_blocks:
            return True
        # Full: only reachable when leases or pins held the last batch back.
        self._evict_down(now, evicted)
        if len(self._last) < self.capacity_blocks:
            return True
        return self._no_victim()

    def _after_insert(self, now: float, evicted: list[BlockHash]) -> None:
        if self.capacity_blocks is not None and len(self._last) >= self._high_blocks:
            self._evict_down(now, evicted)

    def _evict_down(self, now: float, evicted: list[BlockHash]) -> int:
        """One batch: oldest candidates first; a parent freed by its last child's
        eviction joins the batch at its own age."""
        self.num_triggers += 1
        want = len(self._last) - self._low_blocks
        heap = [(t, h) for h, t in self._last.items() if self._is_candidate(h, now)]
        heapq.heapify(heap)
        self._batch, self._batch_now = heap, now
        done = 0
        while heap and done < want:
            _, h = heapq.heappop(heap)
            self._evict(h, evicted)
            done += 1
        self._batch = None
        return done

    def _on_leaf(self, h: BlockHash) -> None:
        if self._batch is not None and self._is_candidate(h, self._batch_now):
            heapq.heappush(self._batch, (self._last[h], h))
