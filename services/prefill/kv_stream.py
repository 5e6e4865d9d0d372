"""A streamed handoff, prefill's I/O (the bookkeeping is streaming.py's): after each step
of a long prompt its new full blocks go to the decode instance named in its job, beside
the next step. A stream opens with a whole KVHold: decode reserves the prompt's blocks,
and the chunks start past those it caches already (decode-side reuse).

`hold_at` is also how a handoff that did not stream learns what decode holds.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol

from nats.aio.client import Client as NATS

from services.prefill.args import PrefillSettings
from services.prefill.offers import KVOffers
from services.prefill.streaming import Outgoing
from shared import bus, errors, subjects
from shared.engine.kv_transfer import KVExport
from shared.engine.llm_engine import LLMEngine
from shared.handoff_messages import KVHeld, KVHold
from shared.messages import Ack, CancelRequest, GenerateRequest, KVChunk
from shared.transfer import KVSender
from shared.transfer.base import HANDOFF

log = logging.getLogger(__name__)


async def hold_at(nc: NATS, decode_id: str, hold: KVHold, timeout_s: float) -> int | None:
    """The blocks decode holds for `hold`, or None if it refused or did not answer (an
    answer too late for a handoff is not lost: the reservation takes the pin)."""
    try:
        held = await bus.request(
            nc, subjects.decode_hold(decode_id), hold, KVHeld, timeout_s=timeout_s
        )
    except errors.HalfmoonError as exc:
        log.info(
            "request %s: decode %s holds nothing for it (%s)",
            hold.request.request_id,
            decode_id,
            exc.message,
        )
        return None
    return held.blocks


class Host(Protocol):
    """What streaming needs of the prefill instance (handlers.PrefillInstance)."""

    settings: PrefillSettings
    nc: NATS
    instance_id: str
    engine: LLMEngine
    offers: KVOffers
    sender: KVSender
    exporter: ThreadPoolExecutor


class KVStreams:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.outgoing: dict[str, Outgoing] = {}  # long prompts whose KV streams to decode
        self.chunks: dict[str, asyncio.Task] = {}  # each streaming prompt's chunk in flight
        self.tasks: set[asyncio.Task] = set()

    def acked(self, request_id: str) -> int:
        """Leading blocks decode has already (engine thread: where the handoff starts)."""
        out = self.outgoing.get(request_id)
        return out.acked if out is not None else 0

    def take(self, request_id: str) -> tuple[Outgoing | None, asyncio.Task | None]:
        """The first token exists: the stream ends, and its chunk in flight (if any)."""
        return self.outgoing.pop(request_id, None), self.chunks.get(request_id)

    async def send_ready(self) -> None:
        """Between steps: each streaming prompt's new full blocks go to its decode
        instance, beside the next step (one chunk in flight per prompt; the next covers
        more)."""
        for rid, out in self.outgoing.items():
            if out.ready():
                out.busy = True
                task = asyncio.create_task(self._send_chunk(rid, out))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                self.chunks[rid] = task
                task.add_done_callback(partial(self._chunk_done, rid))

    def _chunk_done(self, rid: str, task: asyncio.Task) -> None:
        if self.chunks.get(rid) is task:
            del self.chunks[rid]

    async def _send_chunk(self, rid: str, out: Outgoing) -> None:
        host = self.host
        try:
            if not out.opened and not await self._open(out):
                return
            export = await asyncio.get_running_loop().run_in_executor(
                host.exporter, host.engine.export_streamable, rid, out.acked
            )
            if export is not None and not out.stopped:
                await self._offer_chunk(rid, out, export)
        except Exception:
            log.exception("request %s: streaming its KV failed", rid)
            out.stopped = True
        finally:
            out.busy = False

    async def _open(self, out: Outgoing) -> bool:
        """A stream's first step: decode reserves the prompt's blocks and says which it
        holds already (decode-side reuse: the chunks start past them). False: refused."""
        host, req = self.host, out.request
        hold = KVHold(
            request=req,
            prefill_id=host.instance_id,
            num_kv_tokens=len(req.prompt_token_ids),
            whole=True,
        )
        held = await hold_at(host.nc, out.decode_id, hold, host.settings.transfer_timeout_s)
        if held is None:
            out.stopped = True
            return False
        out.opened = True
        out.acked = held if host.settings.decode_reuse else 0
        return True

    async def _offer_chunk(self, rid: str, out: Outgoing, export: KVExport) -> None:
        host = self.host
        handle = await host.offers.offer(HANDOFF, export)
        chunk = KVChunk(request_id=rid, prefill_id=host.instance_id, kv=handle)
        try:
            await bus.request(
                host.nc,
                subjects.decode_stream(out.decode_id),
                chunk,
                Ack,
                timeout_s=host.settings.transfer_timeout_s,
            )
        except errors.HalfmoonError as exc:
            await host.sender.withdraw(handle.transfer_id)
            out.stopped = True
            log.info(
                "request %s: decode %s took no streamed KV past block %d (%s); the rest "
                "goes with the first token",
                rid,
                out.decode_id,
                out.acked,
                exc.message,
            )
            return
        out.acked = export.meta.first_block + export.meta.num_blocks

    def start(self, request_id: str, decode_id: str, request: GenerateRequest) -> None:
        self.outgoing[request_id] = Outgoing(decode_id, request)

    def drop(self, request_id: str) -> None:
        """Cancelled (decode got the same cancel) or failed before the engine ran it."""
        self.outgoing.pop(request_id, None)

    async def end(self, request_id: str) -> None:
        """The request ends here (or is cancelled): a decode instance holding a
        reservation for its stream is told to drop it, through the cancel broadcast."""
        out = self.outgoing.pop(request_id, None)
        if out is not None and out.opened:
            cancel = CancelRequest(request_id=request_id, reason="ended before its handoff")
            await self.host.nc.publish(subjects.CANCEL, cancel.encode())
