"""Teacher-forced scores of a text (the prompt logprobs a request may ask for, and the
quality bench's perplexity): every position's logits through the paged model."""

from __future__ import annotations

import torch

from shared.engine.batch import build_batch
from shared.engine.engine_core import EngineCore
from shared.engine.engine_types import PromptScores
from shared.engine.params import SamplingParams
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence


def score_prompt(core: EngineCore, token_ids: list[int], top_k: int = 0) -> PromptScores:
    """For positions 1 .. n-1: log p(token i | tokens before it), and the `top_k` most
    likely tokens there with their logprobs. Computed chunk by chunk on a throwaway
    sequence (its full blocks stay in the prefix cache). Engine thread only."""
    core.check_fits(token_ids, SamplingParams(max_tokens=1))
    seq = Sequence(
        f"score:{id(token_ids):x}",
        list(token_ids),
        len(token_ids),
        SamplingParams(max_tokens=1),
    )
    out: list[torch.Tensor] = []
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        while seq.num_computed_tokens < seq.num_tokens:
            item = ScheduledSeq(
                seq, min(core.config.max_num_batched_tokens, seq.num_uncomputed_tokens)
            )
            pos = seq.num_computed_tokens
            targets = torch.tensor(
                token_ids[pos + 1 : pos + item.num_new_tokens + 1], dtype=torch.long
            )
            logprobs = _logprobs(core, item, len(targets))
            out.append(logprobs.gather(1, targets.unsqueeze(1)).squeeze(1))
            if top_k:
                top = torch.topk(logprobs, top_k, dim=-1)
                tops.append((top.indices, top.values))
            with core.book:
                core.scheduler.postprocess(item)
    finally:
        with core.book:
            core.blocks.free(seq)
    empty = torch.empty(len(token_ids) - 1, 0)
    return PromptScores(
        torch.cat(out),
        torch.cat([t[0] for t in tops]) if tops else empty.long(),
        torch.cat([t[1] for t in tops]) if tops else empty,
    )


def _logprobs(core: EngineCore, item: ScheduledSeq, rows: int) -> torch.Tensor:
    """Log-softmax over the vocabulary of the chunk's first `rows` positions."""
    with core.book:
        if not core.blocks.allocate(item.seq, item.num_new_tokens):
            raise ValueError("the KV pool has no room to score this text now")
    batch, _ = build_batch([item], core.config.block_size, core.lm.device, all_logits=True)
    logits = core.model.forward(batch).float()
    return torch.log_softmax(logits[:rows], dim=-1)
