"""What a KV load that fails does, chosen per deployment (vLLM's kv_load_failure_policy).

KV reaches an engine three ways: a prefix pulled from another instance, a decode
handoff from prefill, and blocks read back from the disk tier. Any of them can fail (the
holder died, the transfer timed out, a file on disk is unreadable). Then:
- "recompute" (the default): the engine computes the missing KV again. Slower, never
  wrong, and the request goes on.
- "fail": the request ends with a clear error (503, code `kv_load_failed`), at once,
  for deployments where a late answer is worse than none (a client retries, or another
  replica serves it within its SLO).

Each outcome is counted per kind (`halfmoon_kv_load_failures_total{kind, outcome}`).
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

KVLoadFailurePolicy = Literal["recompute", "fail"]
KVLoadKind = Literal["pull", "handoff", "disk"]
KINDS: tuple[KVLoadKind, ...] = ("pull", "handoff", "disk")
OUTCOMES = ("recomputed", "failed")


class KVLoadError(Exception):
    """A request's KV could not be loaded, and the policy is "fail"."""


class KVLoadFailures:
    """Failed KV loads of one engine, by (kind, outcome); read by the metrics at scrape."""

    def __init__(self, policy: KVLoadFailurePolicy) -> None:
        self.policy = policy
        self.counts: Counter[tuple[str, str]] = Counter()

    def failed(self, kind: KVLoadKind) -> bool:
        """Count one failed load of `kind`; True when the policy ends the request."""
        fail = self.policy == "fail"
        self.counts[kind, "failed" if fail else "recomputed"] += 1
        return fail
