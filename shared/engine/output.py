"""A request's output side: incremental detokenization and stop conditions.

Pure bookkeeping (no torch): the tokenizer comes in behind the `Detokenizer` protocol.
Each new token is decoded incrementally (`tokenizers`' DecodeStream, as vLLM does), never
by decoding the whole output again, which made every token cost O(output length). The
state is small and explicit so a request can continue on another process (prefill →
decode) with the same text already emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from shared.engine.params import SamplingParams
from shared.messages import FinishReason

Decode = Callable[[list[int]], str]


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still partial)."""


class StreamDetokenizer:
    """`tokenizers`' DecodeStream over a fast tokenizer, primed with the tokens so far."""

    def __init__(
        self, backend: Any, prefix_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(list(prefix_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


class FullDecodeDetokenizer:
    """Decodes everything again each token: for tokenizers without a fast backend."""

    def __init__(self, decode: Decode, prefix_ids: list[int]) -> None:
        self._decode = decode
        self._ids = list(prefix_ids)
        self._text = decode(self._ids) if self._ids else ""

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""  # an unfinished multi-byte character: wait for the next token
        delta = text[len(self._text) :] if text.startswith(self._text) else ""
        self._text = text
        return delta


def make_detokenizer(
    tokenizer: Any, prefix_ids: list[int], skip_special_tokens: bool = True
) -> Detokenizer:
    """A detokenizer primed with `prefix_ids`; special tokens come out as text unless
    skipped (SamplingParams.skip_special_tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return StreamDetokenizer(backend, prefix_ids, skip_special_tokens)
    if tokenizer is None:
        return FullDecodeDetokenizer(lambda ids: "", prefix_ids)
    return FullDecodeDetokenizer(
        lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), prefix_ids
    )


def decode_all(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    if tokenizer is None or not ids:
        return ""
    text: str = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return text


@dataclass
class StepOutput:
    text: str  # new text to stream (may be empty while held back)
    finish_reason: FinishReason | None


@dataclass
class OutputTracker:
    params: SamplingParams
    detokenizer: Detokenizer
    eos_token_ids: frozenset[int]
    prompt_len: int
    max_model_len: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # every decoded character of the answer so far (stop tokens excluded)
    emitted_text: str = ""  # what has been streamed: a prefix of `text`
    finish_reason: FinishReason | None = None

    def append(self, token_id: int) -> StepOutput:
        """Account for one new token; returns the text to stream and whether we are done."""
        if self.finish_reason is not None:
            raise ValueError("append() after the request finished")
        self.token_ids.append(token_id)
        if self._is_stop_token(token_id):
            # The stop token itself is not part of the answer (OpenAI semantics).
            return self._finish(FinishReason.STOP, self._flush_held())
        self.text += self.detokenizer.step(token_id)
        hit = self._find_stop(self.text)
        if hit is not None:
            return self._finish(FinishReason.STOP, self._emit(self.text[:hit]))
        safe = len(self.text) - self._held_suffix(self.text)
        return self._maybe_length(StepOutput(self._emit(self.text[:safe]), None))

    def stop(self) -> StepOutput:
        """End now, as a stop string would (the grammar is complete): flush held text."""
        return self._finish(FinishReason.STOP, self._flush_held())

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def _is_stop_token(self, token_id: int) -> bool:
        if token_id in self.params.stop_token_ids:
            return True
        return not self.params.ignore_eos and token_id in self.eos_token_ids

    def _emit(self, text: str) -> str:
        # Only what lies past the emitted length goes out: what was streamed stays
        # streamed, never re-sent.
        delta = text[len(self.emitted_text) :]
        self.emitted_text += delta
        return delta

    def _flush_held(self) -> str:
        hit = self._find_stop(self.text)
        return self._emit(self.text if hit is None else self.text[:hit])

    def _find_stop(self, text: str) -> int | None:
        # Only text after what was already emitted can newly contain a stop string.
        start = max(0, len(self.emitted_text) - max((len(s) for s in self.params.stop), default=0))
        best: int | None = None
        for s in self.params.stop:
            pos = text.find(s, start)
            if pos != -1 and (best is None or pos < best):
                best = pos
        return best

    def _held_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that could still become a stop string."""
        held = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _maybe_length(self, out: StepOutput) -> StepOutput:
        at_max = len(self.token_ids) >= self.params.max_tokens
        at_ctx = self.prompt_len + len(self.token_ids) >= self.max_model_len
        if at_max or at_ctx:
            return self._finish(FinishReason.LENGTH, out.text + self._flush_held())
        return out

    def _finish(self, reason: FinishReason, text: str) -> StepOutput:
        self.finish_reason = reason
        return StepOutput(text, reason)
