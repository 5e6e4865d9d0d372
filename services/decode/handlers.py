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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.decode.args import DecodeSettings
from services.worker.instance import EngineInstance, Stream
from shared import bus, errors
from shared.engine.kv_transfer import KVExport, KVMeta
from shared.engine.llm_engine import RequestOutput
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.messages import Ack, CostSample, DecodeJob, Role
from shared.transfer import KVReceiver, TransferFailed

log = logging.getLogger(__name__)
T = TypeVar("T")


class DecodeInstance(EngineInstance):
    role = Role.DECODE

    def __init__(
        self, settings: DecodeSettings, nc: NATS, lm: LoadedModel, receiver: KVReceiver
    ) -> None:
        super().__init__(settings, nc, lm)
        self.settings: DecodeSettings = settings
        self.receiver = receiver
        self.queue: deque[DecodeJob] = deque()  # waiting for pool room: nothing fetched yet
        self._fetches: set[asyncio.Task] = set()
        self._importer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-import")
        self._admitting = asyncio.Lock()  # one pass over the queue at a time, in order

    async def run_import(self, fn: Callable[..., T], *args: Any) -> T:
        """Reservations and imports: beside the step in flight, never behind it."""
        return await asyncio.get_running_loop().run_in_executor(self._importer, fn, *args)

    def close_engine(self) -> None:
        self._importer.shutdown(wait=True, cancel_futures=True)
        super().close_engine()

    async def on_submit(self, msg: Msg) -> None:
        try:
            job = DecodeJob.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad decode job: {exc}"))
            return
        if len(self.queue) >= self.settings.max_queued_handoffs and not self.known(
            job.request.request_id
        ):
            await bus.respond(
                msg, errors.Rejected("decode handoff queue is full", retry_after_s=1.0)
            )
            return
        await self.admit(job)
        await bus.respond(msg, Ack())
        await self.admit_queued()

    async def admit(self, job: DecodeJob) -> None:
        """Queue a handoff; admit_queued reserves its blocks and starts its transfer, now
        if the pool has room, else after a step frees some. A job delivered twice runs
        once."""
        req = job.request
        if self.known(req.request_id):
            return
        # With KV handed over, prefill computed the prompt and its cache hits are the usage's;
        # without (a recompute here), this engine's own are.
        computed_elsewhere = job.kv is not None
        cached = job.cached_tokens if computed_elsewhere else None
        self.streams[req.request_id] = Stream(req, job.events_sent, cached)
        self.queue.append(job)
        self.wake()

    async def after_step(self) -> None:
        """Between steps: the queue's head may fit now that the step freed blocks."""
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
            if job.kv is None:  # re-placed with no KV to pull: recompute it here
                self.queue.popleft()
                await self._recompute(job)
                continue
            try:
                ok = await self.run_import(
                    self.engine.reserve,
                    req.request_id,
                    req.prompt_token_ids,
                    job.output_token_ids,
                    SamplingParams.of(req.sampling),
                    job.kv.num_tokens,
                    req.tenant,
                )
            except ValueError as exc:
                self.queue.popleft()
                await self.finish_with_error(req.request_id, "invalid_request", str(exc))
                continue
            if not ok:
                return  # the pool is full: try again after the next step
            self.queue.popleft()
            self._stats = self.engine.stats()
            task = asyncio.create_task(self._transfer(job))
            self._fetches.add(task)
            task.add_done_callback(self._fetches.discard)

    async def _transfer(self, job: DecodeJob) -> None:
        """Fetch into the reserved blocks and join the batch; on a failed transfer give the
        blocks back and recompute, so nothing is lost."""
        rid = job.request.request_id
        export = await self._fetch(job)
        if rid not in self.streams:  # cancelled during the transfer
            await self.run_import(self.engine.release, rid)
            return
        if export is None:
            await self.run_import(self.engine.release, rid)
            await self._recompute(job)
            return
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
                    kind="handoff",
                    tokens=export.meta.num_tokens,
                    context=0.0,
                    seconds=max(0.0, time.time() - job.first_token_time),
                )
            )
        self._stats = self.engine.stats()
        self.wake()

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
                "request %s: KV transfer from %s failed (%s); recomputing",
                job.request.request_id,
                job.prefill_id,
                exc,
            )
            return None
        self.count_transfer(True, len(payload))
        return export

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
        self._stats = self.engine.stats()
        self.wake()

    async def on_output(self, out: RequestOutput) -> None:
        await self.publish_output(out)

    async def release(self, request_id: str) -> bool:
        """A cancel: drop it from the queue, or give back its reservation."""
        before = len(self.queue)
        self.queue = deque(j for j in self.queue if j.request.request_id != request_id)
        released = await self.run_import(self.engine.release, request_id)
        return released or len(self.queue) < before

    def leased_blocks(self) -> int:
        """Blocks reserved for KV still in transfer."""
        return self._stats.kv_blocks_reserved

    async def fail_running(self, why: str) -> None:
        self.queue.clear()
        await self.fail_all(why)
