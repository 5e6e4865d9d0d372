"""Prometheus metrics of the KV manager, all read at scrape time from the index and the
manager's running totals (the index stays pure bookkeeping)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from services.kvmanager.handlers import KVManager
from services.kvmanager.index import TIERS
from shared.metrics import ScrapeCollector, counter, gauge, new_registry


class KVManagerMetrics:
    def __init__(self, manager: KVManager) -> None:
        self.manager = manager
        self.registry = new_registry()
        self.registry.register(ScrapeCollector(self.collect))

    def collect(self) -> Iterable[Metric]:
        m, index = self.manager, self.manager.index
        yield gauge(
            "halfmoon_kvmanager_index_blocks", "Distinct blocks cached anywhere", float(len(index))
        )
        yield gauge(
            "halfmoon_kvmanager_instances",
            "Instances holding cached blocks",
            float(len(index.instances())),
        )
        usage = [
            (inst, tier, index.usage(inst, tier)) for inst in index.instances() for tier in TIERS
        ]
        yield gauge(
            "halfmoon_kvmanager_blocks",
            "Blocks by holder and tier",
            labels=("instance_id", "tier"),
            samples=[((i, t), u.num_blocks) for i, t, u in usage],
        )
        yield gauge(
            "halfmoon_kvmanager_block_bytes",
            "KV bytes by holder and tier",
            labels=("instance_id", "tier"),
            samples=[((i, t), u.nbytes) for i, t, u in usage],
        )
        yield counter(
            "halfmoon_kvmanager_events", "KV events applied to the index", m.events_applied
        )
        yield counter(
            "halfmoon_kvmanager_match_requests", "Prefix match queries answered", m.match_queries
        )
        yield counter(
            "halfmoon_kvmanager_match_blocks",
            "Blocks asked about by match queries (hit ratio denominator)",
            m.match_blocks,
        )
        yield counter(
            "halfmoon_kvmanager_match_hit_blocks",
            "Leading blocks the best holder had cached (hit ratio numerator)",
            m.match_hit_blocks,
        )
