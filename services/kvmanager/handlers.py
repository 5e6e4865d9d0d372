"""KV manager handlers: KV events keep the global index; match queries read it."""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg

from shared import bus, errors
from shared.messages import KVEvent, KVEventKind, KVMatchReply, KVMatchRequest
from services.kvmanager.index import KVIndex

log = logging.getLogger(__name__)


class KVManager:
    def __init__(self) -> None:
        self.index = KVIndex()
        self.events_applied = 0

    def apply(self, event: KVEvent, now: float) -> None:
        if event.kind == KVEventKind.STORED:
            self.index.stored(event.instance_id, event.tier, event.block_hashes,
                              event.block_nbytes, now)
        elif event.kind == KVEventKind.REMOVED:
            self.index.removed(event.instance_id, event.tier, event.block_hashes)
        else:
            self.index.cleared(event.instance_id)
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
        await bus.respond(msg, KVMatchReply(matches=dict(match.per_instance)))
