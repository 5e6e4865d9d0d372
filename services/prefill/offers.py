"""KV this prefill instance offers on the data plane, until the fetch ends: the blocks it
holds for them (heartbeats report them as leased) and each request's handoff, so that a
cancel withdraws it at once instead of at its TTL."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from shared.engine.kv_transfer import KVExport
from shared.messages import KVHandle
from shared.transfer import KVSender, TransferState
from shared.transfer.base import short_id

log = logging.getLogger(__name__)


class KVOffers:
    def __init__(self, sender: KVSender, ttl_s: float, on_sent: Callable[[int], None]) -> None:
        self.sender = sender
        self.ttl_s = ttl_s
        self.on_sent = on_sent  # called with the bytes of each transfer fetched whole
        # Transfer id -> blocks, and the transfer id of each request's handoff.
        self.leases: dict[str, int] = {}
        self.handoffs: dict[str, str] = {}
        self._watches: set[asyncio.Task[None]] = set()

    async def offer(self, purpose: str, export: KVExport, request_id: str = "") -> KVHandle:
        """Offer KV (the copy off the event loop) for one fetch, watched until it ends; a
        request's handoff names its request."""
        handle = await self.sender.offer_off_loop(
            purpose,
            export.meta.model_dump_json().encode(),
            export.payload(),
            export.meta.num_tokens,
            ttl_s=self.ttl_s,
        )
        self._watch(handle.transfer_id, handle.nbytes, export.meta.num_blocks, request_id)
        return handle

    async def withdraw_handoff(self, request_id: str) -> bool:
        """Withdraw a request's handoff not fetched yet; False if it has none."""
        tid = self.handoffs.pop(request_id, None)
        if tid is None:
            return False
        await self.sender.withdraw(tid)
        return True

    def leased_blocks(self) -> int:
        return sum(self.leases.values())

    def _watch(self, transfer_id: str, nbytes: int, num_blocks: int, request_id: str) -> None:
        self.leases[transfer_id] = num_blocks
        if request_id:
            self.handoffs[request_id] = transfer_id
        task = asyncio.create_task(self._until_done(transfer_id, nbytes, request_id))
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)

    async def _until_done(self, transfer_id: str, nbytes: int, request_id: str) -> None:
        try:
            state = await self.sender.wait(transfer_id, self.ttl_s + 5)
        except TimeoutError:
            state = TransferState.FAILED
        self.sender.states.forget(transfer_id)
        self.leases.pop(transfer_id, None)
        if self.handoffs.get(request_id) == transfer_id:
            del self.handoffs[request_id]
        if state == TransferState.DONE:
            self.on_sent(nbytes)
        else:
            log.warning("KV transfer %s ended %s", short_id(transfer_id), state)
