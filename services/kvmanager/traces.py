"""Mooncake traces: the format, where the default one comes from, and which trace is the
conversation trace (the one docs/design.md's reference figures were measured on).

The repository ships a sample (data/conversation_2pct.jsonl): the requests of 2% of
the conversation trace's conversations, whole and in file order, chosen as `halfmoon
bench replay` samples (services/tools/bench/replay/workload.py: crc32 of a request's first
two hash ids). That rule nests: sampling the sample at 2% (bench replay's default) keeps all
of it, the very requests it keeps from the full trace. 276 requests, 37.52% ideal hit
ratio (the full trace: 37.36%). The full trace is not in the repository: point
HALFMOON_TRACE (or --trace) at it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SAMPLE_TRACE = Path(__file__).parent / "data" / "conversation_2pct.jsonl"
SAMPLE_CONVERSATIONS = 0.02  # the share of conversations it keeps
# trace_digest of the whole conversation trace (Mooncake FAST'25 release, 12,031 requests).
CONVERSATION_TRACE_DIGEST = "cbf0f06b3b3da9f0c37e07a72731ce1619d8b03bf40f2a79e8ec78b17d47d319"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]


class FreshIds:
    """Hash ids for blocks never seen before, numbered in order of first use (as the
    released traces number them): the generators' one counter."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def default_trace() -> str:
    """HALFMOON_TRACE if set, else the repository's sample (never a path of one machine)."""
    return os.environ.get("HALFMOON_TRACE") or str(SAMPLE_TRACE)


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            d = json.loads(line)
            requests.append(
                TraceRequest(d["timestamp"], d["input_length"], d["output_length"], d["hash_ids"])
            )
    return requests


def write_trace(path: str, requests: Sequence[TraceRequest]) -> None:
    """The Mooncake JSONL format, one request per line (what load_trace reads back)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            d = {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": r.hash_ids,
            }
            f.write(json.dumps(d) + "\n")


def trace_digest(requests: Sequence[TraceRequest]) -> str:
    """SHA-256 of the requests' content, whatever the file's formatting."""
    h = hashlib.sha256()
    for r in requests:
        h.update(f"{r.timestamp_ms} {r.input_length} {r.output_length} ".encode())
        h.update(",".join(map(str, r.hash_ids)).encode() + b"\n")
    return h.hexdigest()


def is_conversation_trace(requests: Sequence[TraceRequest]) -> bool:
    """The whole conversation trace, as released (a slice or a --limit of it is not)."""
    return trace_digest(requests) == CONVERSATION_TRACE_DIGEST


def replicate(requests: Sequence[TraceRequest], copies: int) -> list[TraceRequest]:
    """`copies` tenants each sending the whole trace at once: the copies keep the trace's
    timestamps (so `copies` times its request rate) and each gets its own hash ids (its own
    prefixes, its own system prompt: no copy hits another's cache). In arrival order,
    copies of one request side by side."""
    if copies < 1:
        raise ValueError("copies must be >= 1")
    span = 1 + max((h for r in requests for h in r.hash_ids), default=-1)
    out = [
        TraceRequest(
            r.timestamp_ms, r.input_length, r.output_length, [h + k * span for h in r.hash_ids]
        )
        for r in requests
        for k in range(copies)
    ]
    out.sort(key=lambda r: r.timestamp_ms)  # stable: within a timestamp, trace order
    return out
