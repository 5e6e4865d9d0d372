"""One interface for every KV transport, with explicit transfer states.

The sender *offers* a payload under a transfer id and keeps it until the receiver has it
(or the offer expires); the receiver *fetches* by handle. Each transfer moves through

    WAITING → TRANSFERRING → DONE | FAILED

on both sides, so callers (and tests) can poll instead of guessing.
"""

from __future__ import annotations

import abc
import asyncio
import time
from enum import StrEnum
from typing import Callable

from shared.messages import KVHandle


class TransferState(StrEnum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


TERMINAL = frozenset({TransferState.DONE, TransferState.FAILED})


class TransferFailed(Exception):
    """The transfer ended FAILED: timeout, peer gone, checksum mismatch, unknown id."""


class _States:
    """Transfer id → state, with waiters woken on every change."""

    def __init__(self) -> None:
        self._states: dict[str, TransferState] = {}
        self._changed = asyncio.Condition()
        self._began: dict[str, float] = {}
        # Called once per transfer as it ends: (id, DONE | FAILED, seconds since its first
        # state). Metrics hook in here, whatever the transport.
        self.on_end: Callable[[str, TransferState, float], None] | None = None

    def _timed(self, transfer_id: str, state: TransferState) -> None:
        if state not in TERMINAL:
            self._began.setdefault(transfer_id, time.monotonic())
            return
        began = self._began.pop(transfer_id, None)
        if began is not None and self.on_end is not None:
            self.on_end(transfer_id, state, time.monotonic() - began)

    def get(self, transfer_id: str) -> TransferState | None:
        return self._states.get(transfer_id)

    async def set(self, transfer_id: str, state: TransferState) -> None:
        async with self._changed:
            self._states[transfer_id] = state
            self._timed(transfer_id, state)
            self._changed.notify_all()

    def set_initial(self, transfer_id: str, state: TransferState) -> None:
        """Record a first, non-terminal state without waking waiters (no loop needed)."""
        self._states[transfer_id] = state
        self._timed(transfer_id, state)

    async def wait_terminal(self, transfer_id: str, timeout_s: float) -> TransferState:
        async def _wait() -> TransferState:
            async with self._changed:
                await self._changed.wait_for(lambda: self._states.get(transfer_id) in TERMINAL)
                return self._states[transfer_id]

        return await asyncio.wait_for(_wait(), timeout_s)

    def forget(self, transfer_id: str) -> None:
        self._states.pop(transfer_id, None)
        self._began.pop(transfer_id, None)


class KVSender(abc.ABC):
    """Serves offered payloads to receivers. One per process, many transfers."""

    def __init__(self) -> None:
        self.states = _States()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def offer(self, transfer_id: str, meta: bytes, payload: memoryview | bytes,
              num_tokens: int, ttl_s: float) -> KVHandle:
        """Make `payload` fetchable; it is dropped (FAILED) if not fetched within ttl_s."""

    @abc.abstractmethod
    async def withdraw(self, transfer_id: str) -> None:
        """Drop an offer now (FAILED) rather than at its TTL: its request was cancelled or
        its receiver is gone. Unknown or finished transfers are ignored."""

    @property
    @abc.abstractmethod
    def pending(self) -> int:
        """Offers not fetched, withdrawn or expired yet."""

    def state(self, transfer_id: str) -> TransferState | None:
        return self.states.get(transfer_id)

    async def wait(self, transfer_id: str, timeout_s: float) -> TransferState:
        return await self.states.wait_terminal(transfer_id, timeout_s)


class KVReceiver(abc.ABC):
    def __init__(self) -> None:
        self.states = _States()

    @abc.abstractmethod
    async def fetch(self, handle: KVHandle, timeout_s: float) -> tuple[bytes, bytearray]:
        """(meta, payload) or TransferFailed; the state ends DONE or FAILED either way."""

    def state(self, transfer_id: str) -> TransferState | None:
        return self.states.get(transfer_id)
