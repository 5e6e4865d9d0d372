"""Turning a step's scheduled sequences into the model's flat batch (index math only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.scheduler import ScheduledSeq


@dataclass
class ChunkMeta:
    """A multi-token query: rows [start, start+n) of the batch, at positions from `pos0`."""

    start: int
    num_tokens: int
    pos0: int
    block_ids: torch.Tensor  # long, the blocks covering pos0 + num_tokens tokens


@dataclass
class BatchMeta:
    """How the flat batch maps onto sequences. Single-token queries come first."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_blocks: torch.Tensor  # [N] long: where each token's K/V goes
    slot_offsets: torch.Tensor  # [N] long
    num_single: int  # rows [0, num_single) are one-token queries
    single_tables: torch.Tensor  # [num_single, max_blocks] int32
    single_ctx: torch.Tensor  # [num_single] int32: tokens each attends to (itself included)
    chunks: list[ChunkMeta]
    logit_rows: torch.Tensor  # [M] long: rows whose next-token logits are needed


def build_batch(
    scheduled: list[ScheduledSeq], block_size: int, device: str, all_logits: bool = False
) -> tuple[BatchMeta, list[ScheduledSeq]]:
    """The batch, and the scheduled items in batch order (one-token queries first).
    Logits come for each completing item's last row, for every row of one with drafts
    (each row checks the draft after it), or for every row (`all_logits`)."""
    # A sequence's last token and its drafts go as one-token queries each, row j seeing
    # the context up to itself: the kernels (and the rounding) of a decode step, so each
    # row's logits are those the token would get decoded alone.
    singles = [s for s in scheduled if s.num_new_tokens == 1 or s.draft]
    chunks = [s for s in scheduled if s.num_new_tokens > 1 and not s.draft]
    order = singles + chunks
    ids: list[int] = []
    positions: list[int] = []
    blocks: list[int] = []
    offsets: list[int] = []
    logit_rows: list[int] = []
    chunk_meta: list[ChunkMeta] = []
    for item in order:
        seq, n = item.seq, item.num_new_tokens
        start, pos0 = len(ids), seq.num_computed_tokens
        ids.extend(seq.token_ids[pos0 : pos0 + n - len(item.draft)])
        ids.extend(item.draft)
        for p in range(pos0, pos0 + n):
            positions.append(p)
            blocks.append(seq.block_table[p // block_size])
            offsets.append(p % block_size)
        if all_logits or (item.draft and item.completes):  # a draft's row checks it
            logit_rows.extend(range(start, start + n))
        elif item.completes:
            logit_rows.append(start + n - 1)
        if n > 1 and not item.draft:
            nblocks = -(-(pos0 + n) // block_size)
            chunk_meta.append(
                ChunkMeta(
                    start,
                    n,
                    pos0,
                    torch.tensor(seq.block_table[:nblocks], dtype=torch.long, device=device),
                )
            )
    tables, ctx = _single_rows(singles)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = BatchMeta(
        t(ids), t(positions), t(blocks), t(offsets), ctx.shape[0], tables, ctx, chunk_meta,
        t(logit_rows),
    )  # fmt: skip
    return meta, order


def _single_rows(singles: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each one-token query's block table and context (itself included): an item with
    drafts gives one row per token, row j seeing j more tokens than the first."""
    rows = [(item, j) for item in singles for j in range(item.num_new_tokens)]
    width = max((len(s.seq.block_table) for s in singles), default=1)
    tables = torch.zeros(len(rows), width, dtype=torch.int32)
    for row, (item, _) in enumerate(rows):
        tables[row, : len(item.seq.block_table)] = torch.tensor(
            item.seq.block_table, dtype=torch.int32
        )
    ctx = torch.tensor([it.seq.num_computed_tokens + j + 1 for it, j in rows], dtype=torch.int32)
    return tables, ctx
