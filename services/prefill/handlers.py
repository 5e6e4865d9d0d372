"""Prefill: queue of jobs, one prompt at a time on the engine thread, KV offered to decode."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import bus, errors, subjects
from shared.engine.instance import EngineInstance
from shared.engine.runner import LoadedModel
from shared.engine.sampling import Sampler
from shared.messages import Ack, DecodeJob, KVEventKind, PrefillJob, Role
from shared.transfer import KVSender, TransferState
from services.prefill.args import PrefillSettings

log = logging.getLogger(__name__)


class PrefillInstance(EngineInstance):
    role = Role.PREFILL

    def __init__(self, settings: PrefillSettings, nc: NATS, lm: LoadedModel,
                 sender: KVSender) -> None:
        super().__init__(settings, nc, lm)
        self.settings: PrefillSettings = settings
        self.sender = sender
        self.jobs: asyncio.Queue[PrefillJob] = asyncio.Queue()
        self._releases: set[asyncio.Task] = set()

    async def on_submit(self, msg: Msg) -> None:
        try:
            job = PrefillJob.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad prefill job: {exc}"))
            return
        if self.jobs.qsize() >= self.settings.max_queue:
            await bus.respond(msg, errors.Rejected("prefill queue is full", retry_after_s=1.0))
            return
        self.jobs.put_nowait(job)
        self.queue_depth = self.jobs.qsize()
        await bus.respond(msg, Ack())

    async def serve(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                job = await asyncio.wait_for(self.jobs.get(), timeout=0.25)
            except asyncio.TimeoutError:
                continue
            self.queue_depth = self.jobs.qsize()
            if job.request.request_id in self.cancelled:
                log.info("request %s cancelled before prefill", job.request.request_id)
                continue
            self.running += 1
            try:
                await self.process(job)
            finally:
                self.running -= 1

    async def fail_queued(self, why: str) -> None:
        """On shutdown, queued jobs end with a clear error instead of vanishing."""
        while not self.jobs.empty():
            job = self.jobs.get_nowait()
            await self.publish_error(job.request, 0, "unavailable", why)
        self.queue_depth = 0

    async def process(self, job: PrefillJob) -> None:
        req = job.request
        next_index = 0
        try:
            t0 = time.perf_counter()
            logits, cache = await self.run_engine(self.runner.prefill, req.prompt_token_ids)
            tracker = self.tracker(req)
            token = Sampler(req.sampling).sample(logits, 0)
            out = tracker.append(token)
            await self.publish_tokens(req, 0, [token], out.text, out.finish_reason, tracker)
            next_index = 1
            log.info("request %s prefilled %d tokens in %.0f ms", req.request_id,
                     len(req.prompt_token_ids), (time.perf_counter() - t0) * 1e3)
            if out.finish_reason is not None:
                return
            meta, payload = await self.run_engine(
                lambda: self.runner.export(cache, block_size=self.settings.block_size,
                                           block_hashes=req.block_hashes))
            tid = f"{req.request_id}.{uuid.uuid4().hex[:8]}"
            handle = self.sender.offer(tid, meta.model_dump_json().encode(), payload,
                                       meta.num_tokens, ttl_s=self.settings.transfer_timeout_s)
            await self.publish_kv(KVEventKind.STORED, req.block_hashes, self.block_nbytes())
            self._release_later(tid, req.block_hashes)
            djob = DecodeJob(request=req, prefill_id=self.instance_id, kv=handle,
                             output_token_ids=list(tracker.token_ids),
                             emitted_text=tracker.emitted_text, events_sent=next_index,
                             first_token_time=time.time())
            await bus.request(self.nc, subjects.decode_submit(job.decode_id), djob, Ack,
                              timeout_s=5.0)
        except errors.HalfmoonError as exc:
            await self.publish_error(req, next_index, exc.code, f"prefill: {exc.message}")
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the instance
            log.exception("request %s: prefill crashed", req.request_id)
            await self.publish_error(req, next_index, "internal_error",
                                     f"prefill failed: {type(exc).__name__}")

    def _release_later(self, transfer_id: str, hashes: list[int]) -> None:
        """Once decode has the KV (or the offer expired), this instance no longer holds it."""

        async def release() -> None:
            try:
                state = await self.sender.wait(transfer_id, self.settings.transfer_timeout_s + 5)
            except asyncio.TimeoutError:
                state = TransferState.FAILED
            self.sender.states.forget(transfer_id)
            if state != TransferState.DONE:
                log.warning("KV transfer %s ended %s", transfer_id, state)
            await self.publish_kv(KVEventKind.REMOVED, hashes, self.block_nbytes())

        task = asyncio.create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
