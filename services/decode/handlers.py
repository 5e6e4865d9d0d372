"""Decode: admit each request's prompt KV from its prefill instance into the pool, then
continue it in the engine's running batch, streaming every token.

Admission follows SGLang's decode prealloc queue: a handoff first waits in a bounded
queue, holding nothing; when the pool has room, the engine reserves the blocks for its KV
and only then is the transfer started, straight into those blocks. So a full pool never
fetches KV it cannot place (the old way parked fetched KV in an unbounded deque), a
transfer can never find its destination taken, and a full queue refuses new handoffs
instead of growing without bound.

Reserving and importing run on a thread of their own (the engine's importer, see its
module doc), not behind the step in flight: a handoff is reserved as it arrives and joins
the batch at the next step. On the engine thread it waited for the running step to end
before its blocks were reserved, and for the next one before its KV went in: two decode
steps added to every request's first gap, which is most of its TBT when outputs are short.

Before a handoff's KV is offered, prefill asks which leading blocks of the prompt this
pool holds already, and sends only the rest; a long prompt's KV may also stream in while
it is computed. Both are holds (holds.py), made before the handoff comes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Coroutine, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.decode.args import DecodeSettings
from services.decode.holds import SWITCHING, Holds
from services.worker.instance import EngineInstance, Stream
from shared import bus, errors
from shared.engine import omp
from shared.engine.kv_transfer import KVExport, KVMeta
from shared.engine.llm_engine import RequestOutput
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.kv_load import KVLoadError
from shared.messages import Ack, CostSample, DecodeJob, Role
from shared.transfer import KVReceiver, TransferFailed

log = logging.getLogger(__name__)
T = TypeVar("T")


class DecodeInstance(EngineInstance):
    role = Role.DECODE

    def __init__(
        self,
        settings: DecodeSettings,
        nc: NATS,
        lm: LoadedModel,
        receiver: KVReceiver,
        before: EngineInstance | None = None,
    ) -> None:
        super().__init__(settings, nc, lm, before)
        self.settings: DecodeSettings = settings
        self.receiver = receiver
        self.queue: deque[DecodeJob] = deque()  # waiting for pool room: nothing fetched yet
        self._fetches: set[asyncio.Task] = set()
        self._importer = omp.serial_executor("kv-import")  # beside the step, no team (omp.py)
        self._admitting = asyncio.Lock()  # one pass over the queue at a time, in order
        self.kv_holds = Holds(self)  # what this pool holds for handoffs yet to come

    async def run_import(self, fn: Callable[..., T], *args: Any) -> T:
        """Reservations and imports: beside the step in flight, never behind it."""
        return await asyncio.get_running_loop().run_in_executor(self._importer, fn, *args)

    def close_role(self) -> None:
        self._importer.shutdown(wait=True, cancel_futures=True)

    def holds(self) -> str:
        held = [
            f"{n} {what}"
            for n, what in (
                (len(self.queue), "handoffs queued"),
                (len(self.kv_holds.pending), "KV holds (streams or cached prefixes)"),
                (len(self._fetches), "transfers"),
            )
            if n
        ]
        return ", ".join([h for h in [super().holds(), *held] if h])

    async def on_submit(self, msg: Msg) -> None:
        try:
            job = DecodeJob.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad decode job: {exc}"))
            return
        rid = job.request.request_id
        if not self.intake_open and not self.known(rid) and rid not in self.kv_holds:
            # Switching role: the prefill asks the conductor for another decode instance.
            await bus.respond(msg, SWITCHING)
            return
        if len(self.queue) >= self.settings.max_queued_handoffs and not self.known(rid):
            await self.kv_holds.drop(rid)  # the job goes elsewhere, and recomputes what was held
            await bus.respond(
                msg, errors.Rejected("decode handoff queue is full", retry_after_s=1.0)
            )
            return
        await self.admit(job)
        await bus.respond(msg, Ack())
        await self.admit_queued()

    async def admit(self, job: DecodeJob) -> None:
        """Queue a handoff; admit_queued reserves its blocks and starts its transfer, now
        if the pool has room, else after a step frees some. A streamed one has its blocks
        already and goes straight to its transfer. A job delivered twice runs once."""
        req = job.request
        if self.known(req.request_id):
            return
        held = self.kv_holds.take(req.request_id)
        if job.held_blocks and held is None:
            # Its hold is gone (expired, or another instance's): the rest alone is no use.
            log.warning("request %s: held KV no longer held; recomputing", req.request_id)
            job = job.model_copy(update={"kv": None})
        # With KV handed over, prefill computed the prompt and its cache hits are the usage's;
        # without (a recompute here), this engine's own are.
        computed_elsewhere = job.kv is not None
        cached = job.cached_tokens if computed_elsewhere else None
        stream = self.streams[req.request_id] = Stream(req, job.events_sent, cached)
        if job.kv is not None or job.kv_slices:  # what moved, and what it did not need to
            stream.handoff_bytes = held.nbytes if held else 0
            # What prefill skipped of what is held here (a prompt held whole still sends one).
            kept = min(held.held_blocks, job.held_blocks) if held else 0
            stream.handoff_held_tokens = kept * self.settings.block_size
        if held is not None and held.whole and job.kv is not None:
            self.start(self._transfer(job))  # its blocks are reserved already
            return
        if held is not None and job.kv is None:  # nothing to fetch: the blocks go back
            await self.run_import(self.engine.release, req.request_id)
        self.queue.append(job)  # a held prefix stays pinned, and reserve takes the rest
        self.wake()

    def start(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)

    async def after_step(self) -> None:
        """Between steps: the queue's head may fit now that the step freed blocks."""
        await self.kv_holds.expire()
        await self.admit_queued()

    async def admit_queued(self) -> None:
        async with self._admitting:
            await self._admit_queued()

    async def _admit_queued(self) -> None:
        """Reserve blocks for queued handoffs in arrival order, and start each reserved
        one's transfer. The head waits while the pool is full."""
        while self.queue:
            job = self.queue[0]
            req = job.request
            if req.request_id not in self.streams:  # cancelled while it waited
                self.queue.popleft()
                continue
            if job.kv is None and not job.kv_slices:  # re-placed with no KV: recompute here
                self.queue.popleft()
                await self._recompute(job)
                continue
            kv = job.kv or job.kv_slices[0]  # every stage's slice covers the whole prompt
            try:
                ok = await self.run_import(
                    self.engine.reserve,
                    req.request_id,
                    req.prompt_token_ids,
                    job.output_token_ids,
                    SamplingParams.of(req.sampling),
                    kv.num_tokens,
                    req.tenant,
                )
            except ValueError as exc:
                self.queue.popleft()
                await self.finish_with_error(req.request_id, "invalid_request", str(exc))
                continue
            if not ok:
                return  # the pool is full: try again after the next step
            self.queue.popleft()
            self.refresh_stats()
            self.start(self._transfer(job))

    async def _transfer(self, job: DecodeJob) -> None:
        """Fetch into the reserved blocks and join the batch; on a failed transfer give the
        blocks back and recompute, so nothing is lost."""
        rid = job.request.request_id
        if job.kv_slices:
            await self._transfer_slices(job)
            return
        export = await self._fetch(job)
        if rid not in self.streams:  # cancelled during the transfer
            await self.run_import(self.engine.release, rid)
            return
        if export is None:
            await self.run_import(self.engine.release, rid)
            await self._load_failed(job, f"KV transfer from {job.prefill_id} failed")
            return
        self._count_handoff(rid)
        try:
            await self.run_import(
                self.engine.add_reserved, rid, export, job.output_token_ids, job.emitted_text
            )
        except ValueError as exc:
            await self.finish_with_error(rid, "kv_transfer_failed", str(exc))
            return
        if rid not in self.streams:
            # Cancelled while it went in: the cancel's abort (engine thread) may have run
            # before the import (this thread) and found nothing to drop.
            await self.abort(rid)
            return
        if job.first_token_time:  # the conductor's cost model learns what handoffs take
            self.engine.cost_samples.append(
                CostSample(
                    kind="handoff",  # of what moved after the first token, not what streamed
                    tokens=export.meta.num_tokens
                    - export.meta.first_block * self.settings.block_size,
                    context=0.0,
                    seconds=max(0.0, time.time() - job.first_token_time),
                )
            )
        self.refresh_stats()
        self.wake()

    async def _transfer_slices(self, job: DecodeJob) -> None:
        """A pipelined prefill's KV: each stage's layers, fetched and placed one by one; the
        request joins the batch once every layer of every block is in."""
        rid = job.request.request_id
        for handle in job.kv_slices:
            export = await self._fetch(job.model_copy(update={"kv": handle}))
            if rid not in self.streams:  # cancelled during the transfer
                await self.run_import(self.engine.release, rid)
                return
            try:
                if export is None:
                    raise ValueError("a stage's KV slice did not come")
                await self.run_import(self.engine.fill_reserved_slice, rid, export)
            except ValueError as exc:
                await self.run_import(self.engine.release, rid)
                await self._load_failed(job, str(exc))
                return
        self._count_handoff(rid)
        try:
            await self.run_import(
                self.engine.add_reserved_slices, rid, job.output_token_ids, job.emitted_text
            )
        except ValueError as exc:
            await self.run_import(self.engine.release, rid)
            await self.finish_with_error(rid, "kv_transfer_failed", str(exc))
            return
        if rid not in self.streams:
            await self.abort(rid)
            return
        self.refresh_stats()
        self.wake()

    def _count_handoff(self, request_id: str) -> None:
        """A handoff's KV is here: what moved, and what this pool held already."""
        stream = self.streams.get(request_id)
        if stream is None or stream.handoff_bytes is None:
            return
        a = self.kv_activity
        a.handoffs += 1
        a.handoff_bytes += stream.handoff_bytes
        held_blocks = (stream.handoff_held_tokens or 0) // self.settings.block_size
        a.handoff_held_bytes += held_blocks * self.engine.kv.shape.block_nbytes

    async def _fetch(self, job: DecodeJob) -> KVExport | None:
        """The prefilled KV, or None if the transfer failed or timed out."""
        assert job.kv is not None
        try:
            meta_bytes, payload = await self.receiver.fetch(
                job.kv, self.settings.transfer_timeout_s
            )
            export = KVExport.from_bytes(KVMeta.model_validate_json(meta_bytes), payload)
        except (TransferFailed, ValueError) as exc:
            log.warning(
                "request %s: KV transfer from %s failed (%s)",
                job.request.request_id,
                job.prefill_id,
                exc,
            )
            return None
        self.count_transfer(True, len(payload))
        stream = self.streams.get(job.request.request_id)
        if stream is not None and stream.handoff_bytes is not None:
            stream.handoff_bytes += len(payload)
        return export

    async def _load_failed(self, job: DecodeJob, why: str) -> None:
        """The handoff's KV did not come: recompute it here, or (the "fail" policy,
        shared/kv_load.py) end the request."""
        rid = job.request.request_id
        if self.engine.kv_load_failures.failed("handoff"):
            self.refresh_stats()
            await self.finish_with_error(rid, errors.KVLoadFailed.code, why)
            return
        log.warning("request %s: %s; recomputing", rid, why)
        await self._recompute(job)

    async def _recompute(self, job: DecodeJob) -> None:
        """Prompt + tokens so far through this engine: slower than a transfer, never lost."""
        req = job.request
        try:
            await self.run_engine(
                self.engine.add_recompute,
                req.request_id,
                req.prompt_token_ids,
                job.output_token_ids,
                SamplingParams.of(req.sampling),
                job.emitted_text,
                req.tenant,
            )
        except ValueError as exc:
            await self.finish_with_error(req.request_id, "invalid_request", str(exc))
            return
        except KVLoadError as exc:  # a disk block failed, and the policy is "fail"
            await self.finish_with_error(req.request_id, errors.KVLoadFailed.code, str(exc))
            return
        self.refresh_stats()
        self.wake()

    async def on_output(self, out: RequestOutput) -> None:
        await self.publish_output(out)

    async def release(self, request_id: str) -> bool:
        """A cancel: drop it from the queue, or give back its reservation."""
        before = len(self.queue)
        self.queue = deque(j for j in self.queue if j.request.request_id != request_id)
        self.kv_holds.pending.pop(request_id, None)
        released = await self.run_import(self.engine.release, request_id)
        self.refresh_stats()
        return released or len(self.queue) < before

    def leased_blocks(self) -> int:
        """Blocks reserved for KV still in transfer."""
        return self._stats.kv_blocks_reserved

    async def fail_running(self, why: str) -> None:
        self.queue.clear()
        self.kv_holds.pending.clear()
        await self.fail_all(why)
