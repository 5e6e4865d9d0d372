"""What turns a row of model logits into the distribution a request samples from.

In order, for the rows that ask for each (the others pay nothing): logit bias; stop
tokens banned until min_tokens; presence, frequency (OpenAI's, over the output) and
repetition (vLLM's, over prompt and output) penalties; the grammar's mask. Then
sampling.py applies temperature, top-k, top-p and min-p and draws. Each step is a few
tensor ops over the rows concerned, not a loop over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engine.params import SamplingParams


@dataclass
class RowContext:
    """What one row's processing needs besides its params."""

    params: SamplingParams
    step: int  # index of the token being produced (0: the first output token)
    token_ids: list[int] = field(default_factory=list)  # prompt + output so far
    num_prompt_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()  # EOS and stop_token_ids: banned before min_tokens
    matcher: Any = None  # llguidance matcher of a constrained request


def process(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """Apply every row's processors to `logits` [M, V] (fp32, modified in place)."""
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = torch.tensor([t for t, _ in r.params.logit_bias], dtype=torch.long)
            vals = torch.tensor([b for _, b in r.params.logit_bias], dtype=logits.dtype)
            logits[i].index_add_(0, ids.clamp(0, logits.shape[1] - 1), vals)
        if r.step < r.params.min_tokens and r.stop_ids:
            logits[i, list(r.stop_ids)] = float("-inf")
    _penalize(logits, rows)
    _mask(logits, rows)
    return logits


def _penalize(logits: torch.Tensor, rows: list[RowContext]) -> None:
    idx = [i for i, r in enumerate(rows) if r.params.penalized]
    if not idx:
        return
    vocab = logits.shape[1]
    sub = logits[idx]
    outputs = [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in idx]
    counts = _counts(outputs, vocab, sub.dtype)
    presence = torch.tensor([rows[i].params.presence_penalty for i in idx]).unsqueeze(1)
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in idx]).unsqueeze(1)
    sub -= presence * (counts > 0) + frequency * counts
    rep = torch.tensor([rows[i].params.repetition_penalty for i in idx]).unsqueeze(1)
    if bool((rep != 1.0).any()):
        seen = _counts([rows[i].token_ids for i in idx], vocab, sub.dtype) > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    logits[idx] = sub


def _counts(ids: list[list[int]], vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(ids), vocab]: how often each token occurs in each list."""
    width = max((len(x) for x in ids), default=0)
    counts = torch.zeros(len(ids), vocab + 1, dtype=dtype)
    if width:
        padded = torch.full((len(ids), width), vocab, dtype=torch.long)  # pad: a spare column
        for i, x in enumerate(ids):
            padded[i, : len(x)] = torch.tensor(x, dtype=torch.long).clamp(0, vocab - 1)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=dtype))
    return counts[:, :vocab]


def _mask(logits: torch.Tensor, rows: list[RowContext]) -> None:
    idx = [i for i, r in enumerate(rows) if r.matcher is not None]
    if not idx:
        return
    from shared.engine.constraints import allowed

    ok = allowed([rows[i].matcher for i in idx], logits.shape[1])
    logits[idx] = logits[idx].masked_fill(~ok, float("-inf"))


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(raw: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """From the model's own distribution (raw logits, before any processing), as vLLM
    returns them by default: the chosen tokens' logprobs and each row's top k."""
    lp = torch.log_softmax(raw.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1)
    k_max = max(ks, default=0)
    top = torch.topk(lp, k_max, dim=-1) if k_max else None
    out = []
    for i, (tok, k) in enumerate(zip(tokens, ks)):
        pairs: tuple[tuple[int, float], ...] = ()
        if top is not None and k:
            pairs = tuple(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist()))
        out.append(TokenLogprobs(tok, float(chosen[i]), pairs))
    return out
