"""KV a decode instance holds for requests whose handoff has not come yet.

Decode-side reuse (SGLang's decode radix cache): before prefill offers a request's KV it
asks (KVHold) which leading blocks of the prompt this instance caches already, from an
earlier turn of the same conversation or a sibling sample. Those blocks are pinned here
until the handoff comes, and prefill sends only the rest.

A streamed handoff (services/prefill/kv_stream.py) opens with a whole hold: the prompt's
other blocks are reserved too, each chunk is written into them as it comes, and the
handoff after the first token brings what was not acked. A hold whose prefill goes quiet
gives its blocks back after the transfer timeout.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Protocol, TypeVar

from nats.aio.msg import Msg

from services.decode.args import DecodeSettings
from services.worker.instance import CancelSet
from shared import bus, errors
from shared.engine.kv_transfer import KVExport, KVMeta
from shared.engine.llm_engine import LLMEngine
from shared.engine.params import SamplingParams
from shared.handoff_messages import KVHeld, KVHold
from shared.messages import Ack, DecodeJob, KVChunk
from shared.transfer import KVReceiver, TransferFailed

log = logging.getLogger(__name__)
T = TypeVar("T")
SWITCHING = errors.Unavailable("this instance is switching role", code="switching")


class Host(Protocol):
    """What the holds need of the decode instance (handlers.DecodeInstance)."""

    settings: DecodeSettings
    engine: LLMEngine
    receiver: KVReceiver
    queue: deque[DecodeJob]
    intake_open: bool
    cancelled: CancelSet

    async def run_import(self, fn: Callable[..., T], *args: Any) -> T: ...
    def start(self, work: Coroutine[Any, Any, None]) -> None: ...
    def known(self, request_id: str) -> bool: ...
    def count_transfer(self, incoming: bool, nbytes: int) -> None: ...
    def refresh_stats(self) -> None: ...


@dataclass
class Pending:
    """One request's hold."""

    whole: bool  # every block of the prompt reserved (a stream's), or the cached prefix only
    held_blocks: int  # leading blocks this pool had cached, pinned: never sent
    last: float  # time.monotonic() of the hold or of its stream's last chunk
    nbytes: int = 0  # streamed chunks fetched so far


class Holds:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.pending: dict[str, Pending] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.pending

    def take(self, request_id: str) -> Pending | None:
        """The handoff came: its hold, if it still has one (the reservation stays)."""
        return self.pending.pop(request_id, None)

    async def drop(self, request_id: str) -> bool:
        """A cancel, or a handoff refused: the hold's blocks go back."""
        if self.pending.pop(request_id, None) is None:
            return False
        await self.host.run_import(self.host.engine.release, request_id)
        self.host.refresh_stats()
        return True

    async def expire(self) -> None:
        """Holds whose prefill went quiet (it died, and the cancel was lost) give their
        blocks back."""
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            if now - p.last > self.host.settings.transfer_timeout_s:
                await self.drop(rid)
                log.warning("request %s: held KV went quiet; its blocks are freed", rid)

    async def on_hold(self, msg: Msg) -> None:
        try:
            hold = KVHold.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad KV hold: {exc}"))
            return
        # Off this callback, as chunks are: the importer thread may be busy with a transfer.
        self.host.start(self._answer(msg, hold))

    async def _answer(self, msg: Msg, hold: KVHold) -> None:
        await bus.respond(msg, await self._hold(hold))

    async def _hold(self, hold: KVHold) -> KVHeld | errors.HalfmoonError:
        """Pin what this pool holds of the prompt (and with `whole` reserve the rest)."""
        host, req = self.host, hold.request
        rid = req.request_id
        if host.known(rid) or rid in self.pending:
            return errors.Rejected("request already here")
        if not host.intake_open:
            return SWITCHING
        if hold.whole and host.queue:  # handoffs wait for room: a stream does not jump them
            return errors.Rejected("handoffs are waiting for KV pool room")
        try:
            held = await host.run_import(
                host.engine.hold_prefix,
                rid,
                req.prompt_token_ids,
                hold.output_token_ids,
                SamplingParams.of(req.sampling),
                hold.num_kv_tokens,
                req.tenant,
                hold.whole,
            )
        except ValueError as exc:
            return errors.InvalidRequest(str(exc))
        if held is None:
            return errors.Rejected("no KV pool room for the stream")
        if held or hold.whole:
            self.pending[rid] = Pending(hold.whole, held, time.monotonic())
            host.refresh_stats()
        if rid in host.cancelled:  # while it was being held
            await self.drop(rid)
            return errors.Rejected("cancelled")
        return KVHeld(blocks=held)

    # -- a streamed handoff's chunks ------------------------------------------------------
    async def on_chunk(self, msg: Msg) -> None:
        """A streamed chunk of a long prompt's KV, acked once it is written into the
        blocks its stream's hold reserved."""
        try:
            chunk = KVChunk.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad KV chunk: {exc}"))
            return
        # Off this callback: NATS runs a subscription's callbacks one at a time, and one
        # stream's fetch must not hold another's chunk. A stream's own chunks come one at
        # a time anyway (prefill waits for each ack).
        self.host.start(self._take_chunk(msg, chunk))

    async def _take_chunk(self, msg: Msg, chunk: KVChunk) -> None:
        p = self.pending.get(chunk.request_id)
        refused = None if p is not None and p.whole else "no stream under way for this request"
        if refused is None:
            refused = await self._fill(chunk)
        await bus.respond(msg, Ack() if refused is None else errors.Rejected(refused))

    async def _fill(self, chunk: KVChunk) -> str | None:
        """Fetch a chunk into its stream's blocks; why it failed, or None. A failed chunk
        leaves the reservation: the handoff brings what was not acked."""
        host, rid = self.host, chunk.request_id
        try:
            meta_bytes, payload = await host.receiver.fetch(
                chunk.kv, host.settings.transfer_timeout_s
            )
            export = KVExport.from_bytes(KVMeta.model_validate_json(meta_bytes), payload)
            await host.run_import(host.engine.fill_reserved, rid, export)
        except (TransferFailed, ValueError) as exc:
            log.warning("request %s: streamed KV chunk failed (%s)", rid, exc)
            return str(exc)
        host.count_transfer(True, len(payload))
        p = self.pending.get(rid)
        if p is not None:
            p.last = time.monotonic()
            p.nbytes += len(payload)
            # A prefill not reusing what is held here (--no-decode-reuse) sends it anyway.
            p.held_blocks = min(p.held_blocks, export.meta.first_block)
        return None
