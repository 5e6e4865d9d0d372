"""The token-exact part of the prefix cache (BlockManager's, pure bookkeeping): reuse
of a block a prompt ends inside, copied on write.

Full blocks are reused through their chained hashes. A prompt that ends inside a block
(almost every prompt) would recompute up to a block of tokens. So a finished sequence's
last, partly filled block is kept by its parent's hash (the chain before it), and so is
the newest cached full block after each parent. A later prompt whose full blocks match
up to that parent, and whose next tokens agree with such a block's first ones, gets those
tokens' KV copied into a block of its own (`take_copies`, run by the engine before the
step's forward pass writes the rest of it): a repeated prompt recomputes its last token
only. Kept partial blocks are local: never hashed, published or spilled; a free one is
evicted as a cached block is.
"""

from __future__ import annotations

from typing import Iterable

from shared.engine.block import Block
from shared.engine.sequence import Sequence
from shared.hashing import root_hash


class PartialBlocks:
    """BlockManager's token-exact reuse; the pool's own state and moves come from it."""

    block_size: int
    blocks: list[Block]
    _num_empty: int
    # parent hash -> (kept partial block, its tokens); the block's parent by id; parent
    # hash -> the newest cached full block after it; (source, destination) copies owed.
    _partials: dict[int, tuple[int, tuple[int, ...]]]
    _partial_parent: dict[int, int]
    _children: dict[int, int]
    _copies: list[tuple[int, int]]

    def _take(self, block_id: int) -> None:
        raise NotImplementedError

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        raise NotImplementedError

    def release(self, block_ids: Iterable[int]) -> None:
        raise NotImplementedError

    def match_partial(self, seq: Sequence) -> int:
        """After match_prefix: the tokens of a kept partial block that follow `seq`'s
        matched blocks and equal its own next tokens (the last one always left to
        compute), copied into a new block of its own; returns how many (0: none)."""
        full = len(seq.block_table)
        if seq.num_computed_tokens != full * self.block_size:
            return 0
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.salt)
        start = full * self.block_size
        mine = seq.token_ids[start : seq.num_tokens - 1]
        n, src = 0, -1
        for block_id, tokens in self._tails(parent):
            agree = _agreeing(mine, tokens)
            if agree > n:
                n, src = agree, block_id
        if n == 0:
            return 0
        self._take(src)  # held until copied: no allocation may hand it out meanwhile
        if not self.allocate(seq, n):
            self.release([src])
            return 0
        self._copies.append((src, seq.block_table[-1]))
        seq.num_computed_tokens += n
        if seq.num_preemptions == 0:
            seq.num_cached_tokens += n
        return n

    def _tails(self, parent: int) -> list[tuple[int, tuple[int, ...]]]:
        """Blocks after `parent` whose first tokens a prompt may reuse: the kept partial
        one and the newest cached full one."""
        out = []
        if parent in self._partials:
            out.append(self._partials[parent])
        child = self._children.get(parent)
        if child is not None:
            out.append((child, self.blocks[child].token_ids))
        return out

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies match_partial promised, once: the
        caller copies each source's KV into its destination, then `release`s the sources."""
        out, self._copies = self._copies, []
        return out

    def keep_partial(self, seq: Sequence) -> None:
        """Before a finished sequence frees its blocks: keep its last block if it is
        partly filled with computed tokens, under its parent's hash (the newest wins)."""
        full, extra = divmod(seq.num_computed_tokens, self.block_size)
        if not extra or len(seq.block_hashes) != full or len(seq.block_table) <= full:
            return
        block_id = seq.block_table[full]
        if self.blocks[block_id].ref_count != 1 or block_id in self._partial_parent:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.salt)
        old = self._partials.get(parent)
        if old is not None:
            self._drop_partial(old[0])
        start = full * self.block_size
        self._partials[parent] = (block_id, tuple(seq.token_ids[start : start + extra]))
        self._partial_parent[block_id] = parent

    def _drop_partial(self, block_id: int) -> None:
        parent = self._partial_parent.pop(block_id, None)
        if parent is None:
            return
        if self._partials.get(parent, (None,))[0] == block_id:
            del self._partials[parent]
        if self.blocks[block_id].ref_count == 0:
            self._num_empty += 1  # a free block that now holds nothing

    def _is_empty(self, block: Block) -> bool:
        return block.block_hash is None and block.block_id not in self._partial_parent


def _agreeing(mine: list[int], theirs: tuple[int, ...]) -> int:
    """How many leading tokens two runs share."""
    n = 0
    for a, b in zip(mine, theirs):
        if a != b:
            break
        n += 1
    return n
