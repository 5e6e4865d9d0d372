"""KV manager handlers: KV events keep the global index; match queries read it."""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg

from services.kvmanager.heat import PrefixHeat
from services.kvmanager.index import KVIndex, PrefixMatch
from shared import bus, errors
from shared.db.kv_records import KVBlockWriter
from shared.groups import groups_with
from shared.kv_messages import KVMatchReply, KVMatchRequest
from shared.messages import KVEvent, KVEventKind

log = logging.getLogger(__name__)


class KVManager:
    def __init__(
        self,
        records: KVBlockWriter | None = None,
        hot_rps: float = 0.5,
        heat_half_life_s: float = 5.0,
    ) -> None:
        self.index = KVIndex()
        # Hits per cached prefix: the conductor copies a hot one to more holders.
        self.heat = PrefixHeat(heat_half_life_s)
        self.hot_rps = hot_rps
        self.records = records
        self.events_applied = 0
        self.match_queries = 0
        # Hit ratio inputs: blocks asked about, and blocks the best holder had cached.
        self.match_blocks = 0
        self.match_hit_blocks = 0

    def restore(self, rows: list[tuple[int, str, str, int, float]]) -> None:
        """Seed the index from SQL before the stream replay (events are idempotent)."""
        for h, instance, tier, nbytes, last_access in rows:
            self.index.stored(instance, tier, [h], nbytes, last_access)

    def apply(self, event: KVEvent, now: float) -> None:
        rec = self.records
        if event.kind == KVEventKind.STORED:
            self.index.stored(
                event.instance_id, event.tier, event.block_hashes, event.block_nbytes, now
            )
            if rec:
                rec.stored(
                    event.instance_id, event.tier, event.block_hashes, event.block_nbytes, now
                )
        elif event.kind == KVEventKind.REMOVED:
            self.index.removed(event.instance_id, event.tier, event.block_hashes)
            if rec:
                rec.removed(event.instance_id, event.tier, event.block_hashes)
        else:
            # An instance that restarted lost its stage pools too: every group it is in
            # holds nothing any more.
            for holder in [
                event.instance_id,
                *groups_with(self.index.instances(), event.instance_id),
            ]:
                self.index.cleared(holder)
                if rec:
                    rec.cleared(holder)
        self.events_applied += 1

    async def on_event(self, msg: Msg) -> None:
        try:
            event = KVEvent.model_validate_json(msg.data)
        except ValueError:
            log.warning("malformed KV event dropped")
            return
        self.apply(event, time.time())

    async def on_match(self, msg: Msg) -> None:
        try:
            req = KVMatchRequest.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad match request: {exc}"))
            return
        match = self.index.match(req.block_hashes)
        self.match_queries += 1
        best, n = match.best()
        self.match_blocks += len(req.block_hashes)
        self.match_hit_blocks += n
        now = time.time()
        if best is not None and n:
            self.index.touch(req.block_hashes[:n], now)
            self.heat.hit(req.block_hashes[:n], now)
            if self.records:
                self.records.hit(best, "dram", req.block_hashes[:n], now)
        hot, rps = self.heat.hot_run(req.block_hashes[:n], now, self.hot_rps)
        await bus.respond(
            msg,
            KVMatchReply(
                matches={str(k): v for k, v in match.per_instance.items()},
                on_disk=on_disk(match),
                hot_blocks=hot,
                heat_rps=rps,
            ),
        )


def on_disk(match: PrefixMatch) -> dict[str, int]:
    """Per instance, its matched leading blocks past its DRAM run: the ones its engine
    reads back from its disk tier (the engine loads those after the DRAM chain)."""
    out = {}
    for inst, n in match.per_instance.items():
        disk = n - match.per_tier.get(inst, {}).get("dram", 0)
        if disk > 0:
            out[str(inst)] = disk
    return out
