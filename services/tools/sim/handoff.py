"""When a prompt's KV is in place on its decode instance, counted from the end of its
prefill (pure). The first token needs only prefill; every later one waits for this.

- Whole: all the prompt's blocks move after the first token (the cost model's handoff).
- Streamed (the live prefill's `--stream-handoff`, for prompts that `streams`): full
  blocks go to decode chunk by chunk while prefill computes the rest, starting once the
  first chunk is done, so after the first token only the last chunk's blocks move, plus
  whatever the stream had not sent yet (when the link is slower than the compute).
- A group (pipelined prefill) holds each block's KV split by layer range across its
  stages, which send their slices at once: the slowest moves `share` of the bytes.
"""

from __future__ import annotations

import math

from services.conductor.costmodel import CostModel


def tail_blocks(prompt_tokens: int, last_chunk_tokens: int, block_tokens: int) -> int:
    """Blocks the prompt's last chunk writes (the first may be shared with the chunk before)."""
    first = (prompt_tokens - last_chunk_tokens) // block_tokens
    return -(-prompt_tokens // block_tokens) - first


def after_prefill_s(
    cost: CostModel,
    blocks: int,
    quantile: float,
    *,
    share: float = 1.0,
    tail: int | None = None,
    overlap_s: float = 0.0,
) -> float:
    """Seconds from the first token to the KV in place on decode. `tail`: a streamed
    handoff's blocks left for after the first token (None: not streamed); `overlap_s`: how
    long the stream ran beside the prefill; `share`: the slowest sender's part of each
    block's bytes."""

    def part(n: int) -> int:
        return math.ceil(n * share) if n > 0 else 0

    if tail is None or tail >= blocks:
        return cost.handoff_time_s(part(blocks), quantile)
    behind = max(0.0, cost.transfer_s(part(blocks - tail)) - overlap_s)
    return behind + cost.handoff_time_s(part(tail), quantile)
