"""Structured output: a grammar per request, applied as a token mask (llguidance).

llguidance (the guidance project's Rust core, also behind vLLM's and SGLang's structured
output) compiles JSON schemas, regexes and Lark grammars against the tokenizer once, then
gives each step a bitmask of the tokens that keep the text inside the grammar. It runs on
the CPU and computes a mask in tens of microseconds, so only constrained rows pay, and an
unconstrained row in the same batch pays nothing.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import TYPE_CHECKING, Any

import torch

from shared.engine.params import Constraint

if TYPE_CHECKING:  # llguidance itself loads on first use (its Rust core is not small)
    from llguidance._lib import JsonCompileOptions

_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _lltokenizer(tokenizer: Any, vocab_size: int) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


# Compact JSON, one space after separators: with any whitespace allowed, a small model can
# spend its whole budget on newlines and indentation inside an object and never close it.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def grammar(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint; ValueError (with why) if it is invalid."""
    from llguidance import LLMatcher

    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(
            json.dumps({"type": "object"}), defaults=JSON_OPTIONS
        )
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice needs a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "lark":
        return LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown constraint kind {kind!r}")


def matcher(tokenizer: Any, vocab_size: int, constraint: Constraint) -> Any:
    """A fresh matcher for one request; ValueError if the grammar does not compile."""
    from llguidance import LLMatcher

    with _lock:  # building the tokenizer's tables once, from whichever thread asks first
        lltok = _lltokenizer(tokenizer, vocab_size)
    m = LLMatcher(lltok, grammar(constraint))
    if m.is_error():
        raise ValueError(f"{constraint.kind}: {m.get_error()}")
    return m


def validate(tokenizer: Any, vocab_size: int, constraint: Constraint) -> None:
    """Raise ValueError, naming the problem, if the constraint cannot be compiled."""
    matcher(tokenizer, vocab_size, constraint)


def allowed(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """Bool [len(matchers), vocab_size]: the tokens each matcher allows next."""
    words = (vocab_size + 31) // 32
    bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        row = bits[i]
        m.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
    shifts = torch.arange(32, dtype=torch.int32)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1  # [R, words, 32], bit j of word w = token 32w+j
    return unpacked.view(len(matchers), words * 32)[:, :vocab_size].bool()


def caught_up(tokenizer: Any, vocab_size: int, constraint: Constraint, done: list[int]) -> Any:
    """A request's matcher, caught up with the tokens it already has (a request continuing
    here after its prefill elsewhere); ValueError if they break the grammar."""
    m = matcher(tokenizer, vocab_size, constraint)
    if done and not m.consume_tokens(done):
        raise ValueError("the tokens so far do not match the request's grammar")
    return m
