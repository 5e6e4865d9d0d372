"""One accepted (sub-)request's life as its terminal SQL record will tell it, and the clock
its token events are timed against (the gateway's metrics, see metrics.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.db.schema import RequestStatus
from shared.messages import FinishReason, TokenEvent, Usage


class TokenClock(Protocol):
    """Times a request's token events: GatewayMetrics for a request of one choice, or a
    FirstTokenOnce (runs.py) shared by the choices of a fanned-out one."""

    def token_event(self, arrival: float, previous: float | None, now: float) -> None: ...


@dataclass
class RequestLife:
    """What the terminal SQL record will say about one accepted (sub-)request."""

    request_id: str
    arrival: float
    status: RequestStatus = RequestStatus.FAILED
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    usage: Usage | None = None
    text_parts: list[str] = field(default_factory=list)
    # Phase boundaries for the console's timeline: the placement reply, and the first token
    # from an instance other than the one that sent the first (the decode side of a handoff).
    dispatch_time: float | None = None
    decode_first_token_time: float | None = None
    # The KV its handoff moved, and the prompt tokens decode held already (reuse).
    handoff_bytes: int | None = None
    handoff_held_tokens: int | None = None
    first_instance: str = ""
    metrics: TokenClock | None = None
    last_token_time: float | None = None
    num_tokens: int = 0

    def on_event(self, event: TokenEvent) -> None:
        if event.token_ids:
            self._on_tokens(event)
        if event.text:
            self.text_parts.append(event.text)
        if event.usage is not None:
            self.usage = event.usage
        if event.handoff_bytes is not None:
            self.handoff_bytes = event.handoff_bytes
            self.handoff_held_tokens = event.handoff_held_tokens
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason.value
            if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.status = RequestStatus.COMPLETED

    def _on_tokens(self, event: TokenEvent) -> None:
        now = time.time()
        if self.metrics is not None:
            self.metrics.token_event(self.arrival, self.last_token_time, now)
        if self.first_token_time is None:
            self.first_token_time, self.first_instance = now, event.instance_id
        elif (
            self.decode_first_token_time is None
            and event.instance_id
            and event.instance_id != self.first_instance
        ):
            self.decode_first_token_time = now
        self.last_token_time = now
        self.num_tokens += len(event.token_ids)

    def terminal_values(self) -> dict[str, Any]:
        now = time.time()
        values: dict[str, Any] = {
            "finish_time": now,
            "e2e_ms": (now - self.arrival) * 1e3,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }
        if self.first_token_time is not None:
            values["first_token_time"] = self.first_token_time
            values["ttft_ms"] = (self.first_token_time - self.arrival) * 1e3
        for key in (
            "dispatch_time",
            "decode_first_token_time",
            "handoff_bytes",
            "handoff_held_tokens",
        ):
            if getattr(self, key) is not None:
                values[key] = getattr(self, key)
        if self.usage is not None:
            values["completion_tokens"] = self.usage.completion_tokens
            values["cached_tokens"] = self.usage.cached_tokens
        return values
