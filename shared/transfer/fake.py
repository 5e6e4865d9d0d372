"""An in-process transport for unit tests of the code around transfers.

It keeps the real state machine and can be told to fail, so callers' failure paths get
exercised without sockets.
"""

from __future__ import annotations

import asyncio

from shared.messages import KVHandle
from shared.transfer.base import KVReceiver, KVSender, TransferFailed, TransferState


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

    def offer(self, transfer_id: str, meta: bytes, payload: memoryview | bytes,
              num_tokens: int, ttl_s: float) -> KVHandle:
        self.offers[transfer_id] = (meta, bytes(payload))
        self.states.set_initial(transfer_id, TransferState.WAITING)
        return KVHandle(transfer_id=transfer_id, host="fake", port=0, nbytes=len(payload),
                        num_tokens=num_tokens)

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

    async def fetch(self, handle: KVHandle, timeout_s: float) -> tuple[bytes, bytearray]:
        tid = handle.transfer_id
        await self.states.set(tid, TransferState.TRANSFERRING)
        await self.sender.states.set(tid, TransferState.TRANSFERRING)
        try:
            await asyncio.wait_for(asyncio.sleep(self.delay_s), timeout_s)
            if self.fail or tid not in self.sender.offers:
                raise TransferFailed(f"transfer {tid} failed (fake)")
        except (asyncio.TimeoutError, TransferFailed) as exc:
            await self.states.set(tid, TransferState.FAILED)
            await self.sender.states.set(tid, TransferState.FAILED)
            raise TransferFailed(str(exc) or "timeout") from exc
        meta, payload = self.sender.offers.pop(tid)
        await self.states.set(tid, TransferState.DONE)
        await self.sender.states.set(tid, TransferState.DONE)
        return meta, bytearray(payload)
