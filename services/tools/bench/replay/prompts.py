"""Trace requests -> chat prompts that keep the trace's prefix sharing exactly.

A Mooncake trace gives each request the hash ids of its 512-token blocks: equal ids mean
equal content. Each hash id becomes a fixed run of `block_tokens` words, drawn by a seeded
generator from words that are one token each with a leading space (" moon"). A byte-level
BPE splits text before every space, so the token sequence of a prompt is exactly the
concatenation of its blocks' tokens: two requests sharing k leading hash ids share
k * block_tokens leading prompt tokens, behind the same chat-template header.

`block_tokens` (< 512) shrinks the workload to the small model: an input of L trace tokens
becomes ceil(L * block_tokens / 512) words, capped; outputs scale by the same ratio.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from services.kvmanager.traces import TraceRequest

TRACE_BLOCK_TOKENS = 512
_WORD = re.compile(r"^\u0120[a-z]{3,9}$")  # byte-level BPE marks a leading space with "Ġ"


def single_token_words(tokenizer: Any, limit: int = 2048) -> list[str]:
    """Words (with their leading space) that the tokenizer encodes as exactly one token,
    in token-id order so the list is the same on every machine with this tokenizer."""
    vocab = sorted((i, t) for t, i in tokenizer.get_vocab().items() if _WORD.match(t))
    words = []
    for tid, tok in vocab:
        word = " " + tok[1:]
        if tokenizer.encode(word, add_special_tokens=False) == [tid]:
            words.append(word)
            if len(words) == limit:
                break
    if len(words) < 64:
        raise ValueError("this tokenizer has too few single-token words for trace prompts")
    return words


@dataclass(frozen=True)
class PromptPlan:
    content: str  # the user message
    input_tokens: int  # words in it (= its tokens, without the chat template)
    output_tokens: int  # exact completion length asked for (ignore_eos)
    hash_ids: tuple[int, ...]  # the trace blocks it covers (for the ideal hit ratio)


class PromptMaker:
    def __init__(
        self,
        words: Sequence[str],
        block_tokens: int = 16,
        max_input_tokens: int = 1024,
        max_output_tokens: int = 32,
        min_output_tokens: int = 4,
        seed: int = 0,
    ) -> None:
        if not 0 < block_tokens <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in 1..{TRACE_BLOCK_TOKENS}")
        if not 0 < min_output_tokens <= max_output_tokens:
            raise ValueError("need 0 < min_output_tokens <= max_output_tokens")
        self.words = list(words)
        self.block_tokens = block_tokens
        self.max_input = max_input_tokens
        self.max_output = max_output_tokens
        self.min_output = min_output_tokens
        self.seed = seed
        self._block = lru_cache(maxsize=1 << 16)(self._block_words)

    def _block_words(self, hash_id: int) -> tuple[str, ...]:
        rng = random.Random(f"{self.seed}:{hash_id}")  # str seeds hash stably across runs
        return tuple(rng.choice(self.words) for _ in range(self.block_tokens))

    def scale(self, trace_tokens: int) -> int:
        return math.ceil(trace_tokens * self.block_tokens / TRACE_BLOCK_TOKENS)

    def make(self, req: TraceRequest) -> PromptPlan:
        n = min(self.scale(req.input_length), len(req.hash_ids) * self.block_tokens, self.max_input)
        n = max(n, 1)
        blocks = req.hash_ids[: math.ceil(n / self.block_tokens)]
        words = [w for h in blocks for w in self._block(h)][:n]
        out = min(self.max_output, max(self.min_output, self.scale(req.output_length)))
        return PromptPlan("".join(words), n, out, tuple(blocks))


def ideal_hit_ratio(plans: Sequence[PromptPlan], block_tokens: int) -> float:
    """Token-weighted share of the slice's prompt words an unlimited, cluster-wide prefix
    cache could reuse: the leading blocks seen before (whole blocks only), as in the
    trace's own 37.4% figure. The chat-template header, cached after the first request,
    is not counted here."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for p in plans:
        total += p.input_tokens
        full = p.input_tokens // block_tokens
        k = 0
        while k < full and tuple(p.hash_ids[: k + 1]) in seen:
            k += 1
        hit += k * block_tokens
        for i in range(1, len(p.hash_ids) + 1):
            seen.add(tuple(p.hash_ids[:i]))
    return hit / total if total else 0.0
