"""An in-process transport for unit tests of the code around transfers.

It keeps the real state machine and can be told to fail, so callers' failure paths get
exercised without sockets.
"""

from __future__ import annotations

import asyncio

from shared.messages import KVHandle
from shared.transfer.base import (
    HANDOFF,
    KVReceiver,
    KVSender,
    Payload,
    TransferFailed,
    TransferState,
    new_transfer_id,
    short_id,
)


class FakeKVSender(KVSender):
    def __init__(self) -> None:
        super().__init__()
        self.offers: dict[str, tuple[bytes, bytes]] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for tid in list(self.offers):
            self.offers.pop(tid)
            await self.states.set(tid, TransferState.FAILED)

    def offer(
        self, purpose: str, meta: bytes, payload: memoryview | bytes, num_tokens: int, ttl_s: float
    ) -> KVHandle:
        transfer_id = new_transfer_id()
        self.offers[transfer_id] = (meta, bytes(payload))
        self.states.label(transfer_id, purpose)
        self.states.set_initial(transfer_id, TransferState.WAITING)
        return KVHandle(
            transfer_id=transfer_id, host="fake", port=0, nbytes=len(payload), num_tokens=num_tokens
        )

    async def withdraw(self, transfer_id: str) -> None:
        if self.offers.pop(transfer_id, None) is not None:
            await self.states.set(transfer_id, TransferState.FAILED)

    @property
    def pending(self) -> int:
        return len(self.offers)


class FakeKVReceiver(KVReceiver):
    def __init__(self, sender: FakeKVSender, fail: bool = False, delay_s: float = 0.0) -> None:
        super().__init__()
        self.sender, self.fail, self.delay_s = sender, fail, delay_s

    async def fetch(
        self, handle: KVHandle, timeout_s: float, purpose: str = HANDOFF
    ) -> tuple[bytes, Payload]:
        tid = handle.transfer_id
        self.states.label(tid, purpose)
        await self.states.set(tid, TransferState.TRANSFERRING)
        offer = self.sender.offers.pop(tid, None)  # claimed: single use, as on the wire
        if offer is None:
            self.sender.refusals.refused("fake")
            await self.states.set(tid, TransferState.FAILED)
            raise TransferFailed(f"transfer {short_id(tid)}: unknown, used or expired id (fake)")
        await self.sender.states.set(tid, TransferState.TRANSFERRING)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.sleep(self.delay_s)
            if self.fail:
                raise TransferFailed(f"transfer {short_id(tid)} failed (fake)")
        except (TimeoutError, TransferFailed) as exc:
            await self.states.set(tid, TransferState.FAILED)
            await self.sender.states.set(tid, TransferState.FAILED)
            raise TransferFailed(str(exc) or "timeout") from exc
        meta, payload = offer
        await self.states.set(tid, TransferState.DONE)
        await self.sender.states.set(tid, TransferState.DONE)
        return meta, bytearray(payload)
