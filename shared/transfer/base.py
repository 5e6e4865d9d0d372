"""One interface for every KV transport, with explicit transfer states.

The sender *offers* a payload and keeps it until the receiver has it (or the offer
expires); the receiver *fetches* by handle. Each transfer moves through

    WAITING → TRANSFERRING → DONE | FAILED

on both sides, so callers (and tests) can poll instead of guessing.

A transfer id is a capability: whoever presents it gets the KV bytes, which are as
sensitive as the prompt they come from. So the sender mints it (128 random bits, never
derived from a request id, which clients see), it travels only inside the handle on the
control plane, the sender compares it in constant time, and it works once: the first
connection that presents it claims it, and every later one is refused like an unknown id.
Refusals are counted (a metric), and a peer that keeps presenting unknown ids is logged.
Logs and errors show `short_id(id)`, which is enough to follow one transfer and far too
little to use.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from enum import StrEnum
from typing import Callable

from shared.messages import KVHandle

log = logging.getLogger(__name__)
TRANSFER_ID_BYTES = 16  # 128 bits: no one guesses one within an offer's TTL
# What a transfer is for: the metrics' purpose label (prefill names its offers so); a
# hop carries a pipelined prefill's hidden states from one stage to the next.
HANDOFF, PREFIX, HOP = "handoff", "prefix", "hop"


# What a fetch returns: a new bytearray, the caller's own buffer (an allocator's), or a
# writable view of a shared-memory mapping (shm.py); all wrap as tensors without a copy.
Payload = bytearray | memoryview


class TransferState(StrEnum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


TERMINAL = frozenset({TransferState.DONE, TransferState.FAILED})


class TransferFailed(Exception):
    """The transfer ended FAILED: timeout, peer gone, checksum mismatch, unknown id."""


class BadFrame(TransferFailed):
    """A frame no sender of ours would send: another protocol, sizes that do not match the
    offer, a payload whose checksum is wrong, or one cut short. Refused before anything is
    allocated for it, and counted (KVReceiver.bad_frames)."""


def new_transfer_id() -> str:
    return secrets.token_hex(TRANSFER_ID_BYTES)


def short_id(transfer_id: str) -> str:
    """The first 32 of 128 bits, for logs and error messages: the other 96 stay secret."""
    return transfer_id[:8]


def _digest(transfer_id: bytes) -> bytes:
    return hashlib.sha256(transfer_id).digest()


class Capabilities:
    """The transfer ids open to the network, each claimed once.

    Lookups go through the SHA-256 of the presented id, so how long the dict probe takes
    depends on a digest the caller cannot steer towards a real id's digest; the final
    check of the id itself is hmac.compare_digest. Claiming removes the id: a second
    connection with it, even while the first one is still transferring, is refused.
    """

    def __init__(self) -> None:
        self._open: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._open)

    def add(self, transfer_id: str) -> None:
        key = transfer_id.encode()
        self._open[_digest(key)] = key

    def discard(self, transfer_id: str) -> None:
        self._open.pop(_digest(transfer_id.encode()), None)

    def claim(self, presented: bytes) -> str | None:
        """The id, now claimed, if `presented` is an open one; None otherwise."""
        digest = _digest(presented)
        key = self._open.get(digest)
        if key is None or not hmac.compare_digest(key, presented):
            return None
        del self._open[digest]
        return key.decode()


class Refusals:
    """Requests a sender refused (unknown, used, expired or withdrawn ids; malformed
    requests): a running total for the metrics, and runs per peer address for the log.

    One refusal now and then is normal (an offer that expired, a cancel that raced a
    fetch); a run of them from one address is someone guessing. A run is logged at 10,
    100, 1,000 ... refusals in a row, so a guesser cannot flood the log either.
    """

    FIRST_LOGGED = 10
    MAX_PEERS = 4096  # runs kept at most: a scan from many addresses cannot grow memory

    def __init__(self) -> None:
        self.total = 0
        self._runs: dict[str, int] = {}

    def refused(self, peer: str, why: str = "unknown transfer id") -> None:
        self.total += 1
        run = self._runs.pop(peer, 0) + 1
        if len(self._runs) >= self.MAX_PEERS:
            self._runs.pop(next(iter(self._runs)))  # the stalest run goes
        self._runs[peer] = run  # re-inserted: the dict stays in order of last refusal
        if self._logged_at(run):
            log.warning(
                "KV data plane: %s has made %d refused requests in a row (last: %s); "
                "someone may be guessing transfer ids",
                peer,
                run,
                why,
            )

    def accepted(self, peer: str) -> None:
        self._runs.pop(peer, None)

    def run_of(self, peer: str) -> int:
        return self._runs.get(peer, 0)

    @classmethod
    def _logged_at(cls, run: int) -> bool:
        mark = cls.FIRST_LOGGED
        while mark < run:
            mark *= 10
        return mark == run


class _States:
    """Transfer id → state, with waiters woken on every change."""

    def __init__(self) -> None:
        self._states: dict[str, TransferState] = {}
        self._changed = asyncio.Condition()
        self._began: dict[str, float] = {}
        self._purposes: dict[str, str] = {}
        # Called once per transfer as it ends: (id, DONE | FAILED, seconds since its first
        # state, purpose). Metrics hook in here, whatever the transport.
        self.on_end: Callable[[str, TransferState, float, str], None] | None = None

    def label(self, transfer_id: str, purpose: str) -> None:
        """What the transfer is for (HANDOFF, PREFIX): the id itself no longer says."""
        self._purposes[transfer_id] = purpose

    def _timed(self, transfer_id: str, state: TransferState) -> None:
        if state not in TERMINAL:
            self._began.setdefault(transfer_id, time.monotonic())
            return
        began = self._began.pop(transfer_id, None)
        purpose = self._purposes.pop(transfer_id, HANDOFF)
        if began is not None and self.on_end is not None:
            self.on_end(transfer_id, state, time.monotonic() - began, purpose)

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

        async with asyncio.timeout(timeout_s):
            return await _wait()

    def forget(self, transfer_id: str) -> None:
        self._states.pop(transfer_id, None)
        self._began.pop(transfer_id, None)
        self._purposes.pop(transfer_id, None)


class KVSender(abc.ABC):
    """Serves offered payloads to receivers. One per process, many transfers."""

    def __init__(self) -> None:
        self.states = _States()
        self.refusals = Refusals()
        self.port = 0  # where receivers connect, once started (0: an in-process sender)

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def offer(
        self, purpose: str, meta: bytes, payload: memoryview | bytes, num_tokens: int, ttl_s: float
    ) -> KVHandle:
        """Make `payload` fetchable under a new transfer id (the handle's, a capability:
        give it to the receiver over the control plane only); it is dropped (FAILED) if not
        fetched within ttl_s. `purpose` labels it for metrics and logs and is never sent."""

    async def offer_off_loop(
        self, purpose: str, meta: bytes, payload: memoryview | bytes, num_tokens: int, ttl_s: float
    ) -> KVHandle:
        """offer(), with the payload's copy and checksum on a worker thread, so the caller's
        event loop keeps serving (heartbeats, cancels, tokens) meanwhile: a 1k-token
        prompt's KV took a median 59 ms to offer on a loaded 2-core stack, and the KV grows
        with the prompt. Senders with such work override it."""
        return self.offer(purpose, meta, payload, num_tokens, ttl_s)

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
        self.bad_frames = 0  # BadFrame refusals: a buggy or hostile peer, or version skew

    @abc.abstractmethod
    async def fetch(
        self, handle: KVHandle, timeout_s: float, purpose: str = HANDOFF
    ) -> tuple[bytes, Payload]:
        """(meta, payload) or TransferFailed; the state ends DONE or FAILED either way.
        `purpose` labels the transfer for metrics, as the sender labelled its offer."""

    def state(self, transfer_id: str) -> TransferState | None:
        return self.states.get(transfer_id)
