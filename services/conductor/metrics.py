"""Prometheus metrics of the conductor: placements, rejections, how long deciding takes,
and the live instances it can place on (read from the registry at scrape time)."""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client import Counter, Histogram
from prometheus_client.core import Metric

from services.conductor.registry import Registry
from shared.messages import Role
from shared.metrics import DECISION_BUCKETS, ScrapeCollector, gauge, new_registry

# Reasons seen often enough to show as 0 before the first one happens.
KNOWN_REJECTIONS = ("slo_unattainable", "unavailable", "rejected", "timeout")


class ConductorMetrics:
    def __init__(self, instances: Registry) -> None:
        self.instances = instances
        self.registry = r = new_registry()
        self.placements = Counter(
            "halfmoon_conductor_placements",
            "Requests placed (dispatched to a prefill instance), by policy",
            ["policy"],
            registry=r,
        )
        self.rejections = Counter(
            "halfmoon_conductor_rejections",
            "Requests not placed, by error code",
            ["reason"],
            registry=r,
        )
        for reason in KNOWN_REJECTIONS:
            self.rejections.labels(reason)
        self.placement_seconds = Histogram(
            "halfmoon_conductor_placement_seconds",
            "Whole placement of a request: prefix "
            "match, policy, dispatch until the prefill instance acknowledges",
            ["outcome"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.decision_seconds = Histogram(
            "halfmoon_conductor_decision_seconds",
            "One policy decision (pure computation)",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.replications = Counter(
            "halfmoon_conductor_replications",
            "Copies of hot prefixes ordered to more prefill instances (replication.py)",
            registry=r,
        )
        self.replicated_bytes = Counter(
            "halfmoon_conductor_replicated_bytes",
            "KV bytes those copies move (predicted from the cost model's block size)",
            registry=r,
        )
        self.replications_throttled = Counter(
            "halfmoon_conductor_replications_throttled",
            "Copies of hot prefixes held back by the replication budget",
            registry=r,
        )
        r.register(ScrapeCollector(self.collect))

    def placed(self, policy: str, seconds: float) -> None:
        self.placements.labels(policy).inc()
        self.placement_seconds.labels("placed").observe(seconds)

    def rejected(self, reason: str, seconds: float) -> None:
        self.rejections.labels(reason).inc()
        self.placement_seconds.labels("rejected").observe(seconds)

    def collect(self) -> Iterable[Metric]:
        now = time.time()
        yield gauge(
            "halfmoon_conductor_live_instances",
            "Instances with a recent ready heartbeat, by role",
            labels=("role",),
            samples=[((role.value,), len(self.instances.alive(role, now))) for role in Role],
        )
