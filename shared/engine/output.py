"""A request's output side: incremental detokenization and stop conditions.

Pure bookkeeping (no torch): the tokenizer comes in as a `decode` callable. The state is
small and explicit so a request can continue on another process (prefill → decode) with
the same text already emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from shared.messages import FinishReason, SamplingParams

Decode = Callable[[list[int]], str]


@dataclass
class StepOutput:
    text: str  # new text to stream (may be empty while held back)
    finish_reason: FinishReason | None


@dataclass
class OutputTracker:
    params: SamplingParams
    decode: Decode
    eos_token_ids: frozenset[int]
    prompt_len: int
    max_model_len: int
    token_ids: list[int] = field(default_factory=list)
    emitted_text: str = ""
    finish_reason: FinishReason | None = None

    def append(self, token_id: int) -> StepOutput:
        """Account for one new token; returns the text to stream and whether we are done."""
        if self.finish_reason is not None:
            raise ValueError("append() after the request finished")
        if self._is_stop_token(token_id):
            # The stop token itself is not part of the answer (OpenAI semantics).
            self.token_ids.append(token_id)
            return self._finish(FinishReason.STOP, self._flush_held())
        self.token_ids.append(token_id)
        text = self.decode(self._content_ids())
        if text.endswith("\ufffd"):
            # An unfinished multi-byte character: wait for the next token.
            return self._maybe_length(StepOutput("", None))
        hit = self._find_stop(text)
        if hit is not None:
            return self._finish(FinishReason.STOP, self._emit(text[:hit]))
        safe = len(text) - self._held_suffix(text)
        return self._maybe_length(StepOutput(self._emit(text[:safe]), None))

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def _is_stop_token(self, token_id: int) -> bool:
        if token_id in self.params.stop_token_ids:
            return True
        return not self.params.ignore_eos and token_id in self.eos_token_ids

    def _content_ids(self) -> list[int]:
        ids = self.token_ids
        if ids and self._is_stop_token(ids[-1]):
            ids = ids[:-1]
        return ids

    def _emit(self, text: str) -> str:
        # Only what lies past the emitted length goes out: if detokenization ever rewrites
        # earlier text (rare merges), what was streamed stays streamed, never re-sent.
        delta = text[len(self.emitted_text):]
        self.emitted_text += delta
        return delta

    def _flush_held(self) -> str:
        text = self.decode(self._content_ids())
        hit = self._find_stop(text)
        return self._emit(text if hit is None else text[:hit])

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
