"""The live conductor's side of hot-prefix replication: each copy the plan orders
(replication.py, pure) is sent to its target instance, counted and recorded.

The order is a publish, not a request: no placement waits for a copy. The target pulls
the blocks from the source as it pulls any prefix (prefill/prefix_pull.py) and keeps them
as replicas; the KV manager's index then shows it as a holder, which ends the copy's
"in flight" state in the plan. A copy that fails only logs there, and the plan forgets it
after `pending_s`.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS

from services.conductor.metrics import ConductorMetrics
from services.conductor.replication import Copy, ReplicationSettings, Replicator
from services.conductor.views import RequestView, Snapshot
from shared import subjects
from shared.db.records import RecordWriter
from shared.kv_messages import KVReplicate
from shared.messages import GenerateRequest

log = logging.getLogger(__name__)


class Replicas:
    def __init__(
        self,
        settings: ReplicationSettings,
        nc: NATS,
        records: RecordWriter | None,
        metrics: ConductorMetrics,
        now: float,
    ) -> None:
        self.plan = Replicator(settings, now)
        self.nc, self.records, self.metrics = nc, records, metrics

    async def consider(
        self, req: GenerateRequest, view: RequestView, snap: Snapshot, now: float
    ) -> Copy | None:
        """After a placement: order the copy its hot prefix needs, if any."""
        throttled = self.plan.throttled
        copy = self.plan.plan(snap, view, req.block_hashes, now)
        if self.plan.throttled > throttled:
            self.metrics.replications_throttled.inc()
        if copy is None:
            return None
        order = KVReplicate(
            source=copy.source,
            block_hashes=list(copy.block_hashes),
            token_ids=req.prompt_token_ids[: copy.blocks * snap.cost.block_size],
            tenant=req.tenant,
            heat_rps=copy.heat_rps,
            blocks=copy.blocks,
        )
        try:
            await self.nc.publish(subjects.prefill_replicate(copy.target), order.encode())
        except Exception as exc:  # noqa: BLE001 - the request is placed: a copy is optional
            log.warning("hot prefix copy to %s not sent: %s", copy.target, exc)
            return None
        self.metrics.replications.inc()
        self.metrics.replicated_bytes.inc(copy.nbytes)
        log.info(
            "request %s: hot prefix of %d blocks %s -> %s: %s",
            req.request_id, copy.blocks, copy.source, copy.target, copy.reason,
        )  # fmt: skip
        if self.records is not None:
            self.records.replication(
                created=now,
                prefix_hash=copy.block_hashes[-1],
                blocks=copy.blocks,
                nbytes=copy.nbytes,
                source=copy.source,
                target=copy.target,
                heat_rps=copy.heat_rps,
                holders=copy.holders,
                reason=copy.reason,
            )
        return copy
