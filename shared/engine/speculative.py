"""Speculative decoding by prompt lookup (pure bookkeeping, no torch).

A decoding sequence whose last few tokens occurred earlier in its own context (the
prompt or the output so far) is likely to go on as it did there: a summary quotes its
document, a code edit copies the lines around the change. The drafter proposes the
tokens that followed that earlier occurrence; the engine runs the last token and the
drafts through the model in one step, as a small prefill chunk, and keeps the drafts
the model agrees with, plus the model's own next token. A step then yields from one to
k + 1 tokens for about the cost of one (decode reads every weight once, whatever the
rows). Greedy output is the output without speculation; sampled output keeps the
model's distribution (sampling.verify_drafts: rejection sampling against a draft that
is a point mass).

As vLLM's `ngram` method (its field names): num_speculative_tokens drafts at most,
from the longest suffix of prompt_lookup_max down to prompt_lookup_min tokens that
occurred before; none once more than disable_by_batch_size sequences decode (a big
batch is bound by compute, not by reading the weights, so a draft costs what it saves).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.params import SamplingParams


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 0  # 0: off
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4  # no drafts when more sequences decode than this

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be 0 (off) or more")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


def why_not(params: SamplingParams) -> str | None:
    """Why a request's tokens cannot be drafted (None: they can). The logit processors
    that depend on the tokens before (penalties, grammars, min_tokens) would need each
    draft's own history in its verification row; logprobs would need each row's."""
    if params.penalized:
        return "penalties"
    if params.constraint is not None:
        return "structured output"
    if params.logprobs is not None:
        return "logprobs"
    if params.logit_bias:
        return "logit_bias"
    if params.min_tokens:
        return "min_tokens"
    return None


class NgramDrafter:
    """Where each n-gram of a sequence last occurred, built as the sequence grows.

    `_next[n][gram]` is the index just after the latest occurrence of `gram` among the
    n-grams that end before the last token (the sequence's own suffix always occurs at
    its end, with nothing after it). Updating it costs a few dict writes per new token;
    a scan of the whole context every step would cost a 32k-token sequence milliseconds.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._next: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        }
        self._indexed = 0  # n-grams ending before this index are in _next

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest recurring suffix of `tokens`."""
        if limit <= 0:
            return []
        self._index(tokens)
        for n in range(self.config.prompt_lookup_max, self.config.prompt_lookup_min - 1, -1):
            if len(tokens) <= n:
                continue
            at = self._next[n].get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at : at + limit]
        return []

    def _index(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # n-grams ending at the last token are the query itself
        for stop in range(self._indexed + 1, end + 1):  # n-gram tokens[stop - n : stop]
            for n, table in self._next.items():
                if stop >= n:
                    table[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)


def accept_greedy(draft: list[int], targets: list[int]) -> int:
    """How many drafts the model's own greedy tokens confirm, in order (`targets[j]` is
    its token after the j-th row: the last known token, then each draft)."""
    accepted = 0
    for proposed, wanted in zip(draft, targets):
        if proposed != wanted:
            break
        accepted += 1
    return accepted
