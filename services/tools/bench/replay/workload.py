"""Which trace requests to replay, and when: a slice of the trace, optionally a sample of its
conversations, with arrival times scaled.

Sampling whole conversations (a request's first two hash ids: the shared system prompt and
the conversation's own opening) instead of a time window keeps every later turn with the
turns it extends, so a small slice keeps the trace's prefix reuse: 2% of the conversation
trace's conversations have its 37-38% ideal hit ratio, a 200-request window only 7%.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

from services.kvmanager.traces import TraceRequest


@dataclass(frozen=True)
class SliceSpec:
    start: int = 0  # first trace line
    limit: int | None = None  # lines from there (None: to the end)
    sample_conversations: float = 1.0  # share of conversations kept (1: all)
    max_requests: int | None = None  # cap after sampling
    time_scale: float = 1.0  # arrival = trace timestamp x this (0.1: ten times faster)


def conversation_key(req: TraceRequest) -> tuple[int, ...]:
    return tuple(req.hash_ids[:2])


def keeps(req: TraceRequest, fraction: float) -> bool:
    """Deterministic per conversation (crc32, the same on every machine and run)."""
    if fraction >= 1.0:
        return True
    digest = zlib.crc32(repr(conversation_key(req)).encode())
    return digest % 1_000_000 < fraction * 1_000_000


def select(trace: Sequence[TraceRequest], spec: SliceSpec) -> list[TraceRequest]:
    end = None if spec.limit is None else spec.start + spec.limit
    chosen = [r for r in trace[spec.start : end] if keeps(r, spec.sample_conversations)]
    return chosen[: spec.max_requests] if spec.max_requests is not None else chosen


def arrivals(requests: Sequence[TraceRequest], time_scale: float) -> list[float]:
    """Seconds after the replay starts: the first request at 0."""
    if not requests:
        return []
    t0 = requests[0].timestamp_ms
    return [(r.timestamp_ms - t0) / 1e3 * time_scale for r in requests]
