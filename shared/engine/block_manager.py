"""KV block pool bookkeeping with prefix caching (pure: no torch, no I/O).

Blocks hold `block_size` tokens. A block whose tokens are all computed gets the chained
hash of its prefix (shared.hashing) and is registered in the prefix cache, so a later
sequence with the same prefix reuses it instead of recomputing. A block nobody uses
(ref count 0) goes to the free list but keeps its hash until the block is handed out
again: freed blocks stay cached until evicted, least recently freed first. A finished
sequence frees its blocks tail first, so a chain's tail is evicted before its parents.
Replicas (blocks copied here from another holder of a hot prefix, `mark_replicas`) are
evicted before any other cached block: another copy exists, while this pool may hold the
last copy of the rest.

A prompt that ends inside a block reuses that block's agreeing tokens too, copied on
write (partial_blocks.py: the token-exact part).

Callers that know only block hashes (the trace replay and the simulator, through
services/kvmanager/pool.py) use the same pool through `take_cached` / `take_new` /
`release`, and `add_blocks` grows a pool that stands for an unlimited one.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import OrderedDict
from typing import Iterable

from shared.engine.block import Block
from shared.engine.partial_blocks import PartialBlocks
from shared.engine.sequence import Sequence
from shared.hashing import hash_block, root_hash


@functools.lru_cache(maxsize=64)  # evict_to_watermark may ask after every block
def watermark_marks(num_blocks: int, high: float, ratio: float) -> tuple[int, int]:
    """(trigger, target) in blocks: evict once `high` of the pool is reached, down to
    `high - ratio`, and always by at least one block, or a tiny pool would never make
    progress."""
    if not 0.0 < high <= 1.0 or not 0.0 < ratio <= high:
        raise ValueError(f"need 0 < ratio <= high <= 1, got high {high}, ratio {ratio}")
    trigger = max(1, math.ceil(num_blocks * high))
    return trigger, min(trigger - 1, math.floor(num_blocks * (high - ratio)))


class BlockManager(PartialBlocks):
    def __init__(
        self, num_blocks: int, block_size: int, hot_hits: int = 0, pin_ttl_s: float = 60.0
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive sizes, got {num_blocks} blocks of {block_size}")
        self.block_size = block_size
        # Hot shared prefixes (system prompts): a block hit this often is soft-pinned for a
        # while, so a burst of one-off prompts does not evict it. 0 turns pinning off.
        self.hot_hits = hot_hits
        self.pin_ttl_s = pin_ttl_s
        self.now = 0.0  # set by the engine each step: bookkeeping never reads the clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_replicas: OrderedDict[int, None] = OrderedDict()  # of _free, least recent first
        self._num_empty = num_blocks  # free blocks holding no cached data
        self._by_hash: dict[int, int] = {}
        self.num_evictions = 0
        # Hashes registered / evicted since the last drain: the instance's KV events.
        self._stored_log: list[int] = []
        self._evicted_log: list[int] = []
        # Evicted blocks whose data is still in place until the caller writes over it:
        # (hash, block id, tokens), for spilling to a lower tier. Only kept when asked.
        self.keep_spills = False
        self._spills: list[tuple[int, int, tuple[int, ...]]] = []
        # Partly filled blocks of finished sequences: parent hash -> (block id, tokens),
        # the block's parent by id, and (source, destination) copies the engine owes.
        self._partials: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._partial_parent: dict[int, int] = {}
        # parent hash -> the newest cached full block after it: its first tokens serve a
        # prompt that ends inside it (its answer filled the block the prompt ended in).
        self._children: dict[int, int] = {}
        self._copies: list[tuple[int, int]] = []

    # -- queries ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks that hold no cached data: handing one out evicts nothing."""
        return self._num_empty

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self._by_hash)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def cached_hashes(self) -> list[int]:
        return list(self._by_hash)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------
    def cacheable_tokens(self, seq: Sequence) -> int:
        """Prompt tokens in full blocks a later identical prompt could reuse (match_prefix
        always leaves the last token to compute)."""
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def prompt_key(self, seq: Sequence) -> int | None:
        """The chained hash of the prompt's last cacheable block (None: no full block):
        equal keys mean the same cacheable prompt, tenant salt included."""
        if not seq.prompt_key_known:
            n = self.cacheable_tokens(seq) // self.block_size
            parent = root_hash(seq.salt)
            for i in range(n):
                parent = hash_block(
                    parent, tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                )
            seq.prompt_key, seq.prompt_key_known = (parent if n else None), True
        return seq.prompt_key

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks of `seq`'s prefix; returns the tokens they cover.

        At least one token is always left to compute: its logits give the next token.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"{seq.request_id}: match_prefix on a sequence that has blocks")
        limit = (seq.num_tokens - 1) // self.block_size
        parent: int = root_hash(seq.salt)
        matched: list[int] = []
        hashes: list[int] = []
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = hash_block(parent, tokens)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
            hashes.append(h)
            parent = h
        for block_id in matched:
            self._take(block_id)
            self._hit(self.blocks[block_id])
        seq.block_table = matched
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(matched) * self.block_size
        if seq.num_preemptions == 0:  # a recompute's hits on its own blocks are not "cached"
            seq.num_cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> list[int]:
        """Register `seq`'s newly completed full blocks in the prefix cache; returns their
        hashes."""
        full = seq.num_computed_tokens // self.block_size
        new: list[int] = []
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.salt)
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = hash_block(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            if h not in self._by_hash:
                # An identical block computed concurrently keeps the first registration.
                self._by_hash[h] = block.block_id
                block.block_hash, block.token_ids = h, tokens
                block.parent_hash = parent
                self._children[parent] = block.block_id
                self._stored_log.append(h)
            seq.block_hashes.append(h)
            new.append(h)
            parent = h
        return new

    def cached_chain(self, hashes: Iterable[int]) -> list[int]:
        """Block ids of the longest leading run of `hashes` this pool has cached."""
        out: list[int] = []
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    # -- hash-only callers --------------------------------------------------------------
    def take_cached(self, block_hash: int) -> int | None:
        """Hold the cached block of `block_hash` (a hit); its id, or None if not cached.
        No tokens to verify against: for callers that know only hashes (trace replay)."""
        block_id = self._by_hash.get(block_hash)
        if block_id is not None:
            self._take(block_id)
            self._hit(self.blocks[block_id])
        return block_id

    def take_new(self, block_hash: int) -> int | None:
        """Hold a block registered under `block_hash`, evicting the least recently freed one
        if no empty block is left; None (nothing taken) if every block is in use."""
        if block_hash in self._by_hash:
            raise ValueError(f"block {block_hash:#x} is cached: take_cached it")
        if not self._free:
            return None
        block_id = self._victim()
        self._evict_hash(block_id)
        self._take(block_id)
        block = self.blocks[block_id]
        self._by_hash[block_hash] = block_id
        block.block_hash = block_hash
        self._stored_log.append(block_hash)
        return block_id

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in order: of those that become free, the
        first released is the first evicted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed with ref count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.replica:
                    self._free_replicas[block_id] = None
                if self._is_empty(block):
                    # Nothing cached in it: hand it out before any block that is, so a
                    # partial tail freed now never costs a cached prefix its place.
                    self._free.move_to_end(block_id, last=False)
                    self._num_empty += 1

    def add_blocks(self, num_blocks: int) -> None:
        """Grow the pool by `num_blocks` empty blocks, handed out before anything cached is
        evicted (a pool standing for an unlimited one grows instead of evicting)."""
        if num_blocks <= 0:
            raise ValueError(f"need a positive block count, got {num_blocks}")
        for block_id in range(len(self.blocks), len(self.blocks) + num_blocks):
            self.blocks.append(Block(block_id))
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        self._num_empty += num_blocks

    # -- allocation ---------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for `num_new_tokens` more tokens; False (nothing taken) if the pool is short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block_id = self._victim()
            self._evict_hash(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        return True

    def pin(self, hashes: list[int], ttl_s: float) -> int:
        """Soft-pin cached blocks by hash until now + ttl_s; returns how many were found."""
        n = 0
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is not None:
                block = self.blocks[block_id]
                block.pinned_until = max(block.pinned_until, self.now + ttl_s)
                n += 1
        return n

    def mark_replicas(self, hashes: Iterable[int]) -> int:
        """These cached blocks came as copies of a prefix another instance holds: evict
        them before any other cached block. Returns how many were found."""
        n = 0
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                continue
            self.blocks[block_id].replica = True
            if block_id in self._free:
                self._free_replicas[block_id] = None
            n += 1
        return n

    def evict_to_watermark(self, high: float, ratio: float) -> int:
        """Mooncake Store's policy: once the blocks holding data (in use or cached) reach
        `high` of the pool, evict least recently freed cached blocks (unpinned, unleased:
        only free ones) down to `high - ratio`. Returns blocks evicted. O(1) below the
        mark, so it may run after every block. Optional: allocation also evicts on demand."""
        held = self.num_blocks - self._num_empty
        trigger, target = watermark_marks(self.num_blocks, high, ratio)
        if held < trigger:
            return 0
        evicted = 0
        for block_id in itertools.chain(list(self._free_replicas), self._free):  # replicas first
            if held <= target:
                break
            block = self.blocks[block_id]
            if block_id in self._partial_parent:
                self._drop_partial(block_id)
                held -= 1
            elif block.block_hash is not None and block.pinned_until <= self.now:
                # _evict_hash leaves the free list as it is; a replica seen twice is empty
                self._evict_hash(block_id)
                held -= 1
                evicted += 1
        return evicted

    def _victim(self) -> int:
        """An empty block; else the least recently freed replica; else the least recently
        freed block; passing over soft-pinned ones while others exist."""
        first = next(iter(self._free))
        if self._is_empty(self.blocks[first]):
            return first
        for block_id in self._free_replicas:
            if self.blocks[block_id].pinned_until <= self.now:
                return block_id
        for block_id in self._free:
            if self.blocks[block_id].pinned_until <= self.now:
                return block_id
        return next(iter(self._free))

    def _hit(self, block: Block) -> None:
        block.hits += 1
        if self.hot_hits and block.hits >= self.hot_hits:
            block.pinned_until = self.now + self.pin_ttl_s

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first (so tails are evicted before their parents)."""
        self.release(reversed(seq.block_table))
        seq.block_table = []
        seq.block_hashes = []

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._free_replicas.pop(block_id, None)
            self._num_empty -= self._is_empty(block)
        block.ref_count += 1

    def _evict_hash(self, block_id: int) -> None:
        self._drop_partial(block_id)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            block.hits, block.pinned_until, block.replica = 0, 0.0, False
            self._free_replicas.pop(block_id, None)
            self._num_empty += block.ref_count == 0  # evicted from the free list
            if block.parent_hash is not None and self._children.get(block.parent_hash) == block_id:
                del self._children[block.parent_hash]
            block.parent_hash = None
            if self._by_hash.get(block.block_hash) == block_id:
                del self._by_hash[block.block_hash]
                self.num_evictions += 1
                self._evicted_log.append(block.block_hash)
                if self.keep_spills:
                    self._spills.append((block.block_hash, block_id, block.token_ids))
            block.block_hash, block.token_ids = None, ()

    def take_spills(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Blocks evicted since the last call; read their data before it is overwritten."""
        out, self._spills = self._spills, []
        return out

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, evicted) block hashes since the last call."""
        stored, evicted = self._stored_log, self._evicted_log
        self._stored_log, self._evicted_log = [], []
        return stored, evicted

    def check_invariants(self) -> None:
        for block in self.blocks:
            if block.ref_count < 0 or (block.ref_count == 0) != (block.block_id in self._free):
                raise RuntimeError(f"block {block.block_id}: ref {block.ref_count} vs free list")
        empty = sum(1 for b in self._free if self._is_empty(self.blocks[b]))
        if empty != self._num_empty:
            raise RuntimeError(f"{empty} empty free blocks, counted {self._num_empty}")
        for block_id in self._free_replicas:
            if block_id not in self._free or not self.blocks[block_id].replica:
                raise RuntimeError(f"block {block_id} listed as a free replica")
        for h, block_id in self._by_hash.items():
            if self.blocks[block_id].block_hash != h:
                raise RuntimeError(f"hash map points at block {block_id} holding another hash")
