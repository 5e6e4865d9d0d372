"""Placement policies: pure functions over the live instances, no I/O.

The KVCache-centric policy (Mooncake's Algorithm 1) builds on the same shape.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from services.conductor.registry import InstanceState


class Policy(Protocol):
    name: str

    def rank(self, candidates: list[InstanceState]) -> list[InstanceState]:
        """Candidates, best first (the caller falls back down the list on failure)."""


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, candidates: list[InstanceState]) -> list[InstanceState]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda s: s.info.instance_id)
        k = next(self._counter) % len(ordered)
        return ordered[k:] + ordered[:k]


class LeastLoaded:
    """Fewest queued + running requests; ties go round-robin so equal nodes share work."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._rr = RoundRobin()

    def rank(self, candidates: list[InstanceState]) -> list[InstanceState]:
        rotated = self._rr.rank(candidates)
        position = {id(s): i for i, s in enumerate(rotated)}
        return sorted(rotated, key=lambda s: (s.load, position[id(s)]))


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
