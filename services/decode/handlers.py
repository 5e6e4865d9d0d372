"""Decode: pull each request's prompt KV from its prefill instance into the pool, then
continue it in the engine's running batch, streaming every token."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import bus, errors
from shared.engine.instance import EngineInstance, Stream
from shared.engine.kv_transfer import KVExport, KVMeta
from shared.engine.llm_engine import RequestOutput
from shared.engine.runner import LoadedModel
from shared.messages import Ack, DecodeJob, Role
from shared.transfer import KVReceiver, TransferFailed
from services.decode.args import DecodeSettings

log = logging.getLogger(__name__)


class DecodeInstance(EngineInstance):
    role = Role.DECODE

    def __init__(self, settings: DecodeSettings, nc: NATS, lm: LoadedModel,
                 receiver: KVReceiver) -> None:
        super().__init__(settings, nc, lm)
        self.settings: DecodeSettings = settings
        self.receiver = receiver
        self.pending: deque[tuple[DecodeJob, KVExport]] = deque()  # fetched, waiting for room
        self._fetches: set[asyncio.Task] = set()
        self._admitting: set[str] = set()  # request ids whose KV is being fetched

    async def on_submit(self, msg: Msg) -> None:
        try:
            job = DecodeJob.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad decode job: {exc}"))
            return
        task = asyncio.create_task(self.admit(job))
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)
        await bus.respond(msg, Ack())

    async def admit(self, job: DecodeJob) -> None:
        """Pull the KV from prefill (data plane), then join the batch when there is room.
        With no KV to pull (a re-placed request), or a pull that failed, recompute it here."""
        req = job.request
        rid = req.request_id
        if self.known(rid) or rid in self._admitting:  # a job delivered twice runs once
            return
        self._admitting.add(rid)
        try:
            export = await self._fetch(job) if job.kv is not None else None
        finally:
            self._admitting.discard(rid)
        if rid in self.cancelled:
            return
        self.streams[rid] = Stream(req, job.events_sent, job.cached_tokens)
        if export is None:
            await self._recompute(job)
            return
        self.pending.append((job, export))
        self.wake()  # the engine loop admits it between steps (one admitter, no races)

    async def _fetch(self, job: DecodeJob) -> KVExport | None:
        """The prefilled KV, or None if the transfer failed or timed out."""
        assert job.kv is not None
        try:
            meta_bytes, payload = await self.receiver.fetch(job.kv, self.settings.transfer_timeout_s)
            export = KVExport.from_bytes(KVMeta.model_validate_json(meta_bytes), payload)
        except (TransferFailed, ValueError) as exc:
            log.warning("request %s: KV transfer from %s failed (%s); recomputing",
                        job.request.request_id, job.prefill_id, exc)
            return None
        self.count_transfer(True, len(payload))
        return export

    async def _recompute(self, job: DecodeJob) -> None:
        """Prompt + tokens so far through this engine: slower than a transfer, never lost."""
        req = job.request
        try:
            await self.run_engine(self.engine.add_recompute, req.request_id, req.prompt_token_ids,
                                  job.output_token_ids, req.sampling, job.emitted_text, req.tenant)
        except ValueError as exc:
            await self.finish_with_error(req.request_id, "invalid_request", str(exc))
            return
        self._stats = self.engine.stats()
        self.wake()

    async def after_step(self) -> None:
        while self.pending:
            # Off the queue while the engine adds it: a cancel meanwhile (release) rebuilds
            # the queue and must not see, or shift, the one in flight.
            job, export = self.pending.popleft()
            req = job.request
            if req.request_id not in self.streams:  # cancelled while waiting
                continue
            try:
                ok = await self.run_engine(self.engine.add_prefilled, req.request_id,
                                           req.prompt_token_ids, job.output_token_ids,
                                           req.sampling, export, job.emitted_text, req.tenant)
            except ValueError as exc:
                await self.finish_with_error(req.request_id, "kv_transfer_failed", str(exc))
                continue
            if not ok:
                self.pending.appendleft((job, export))
                return  # the pool is full: try again after the next step
            self._stats = self.engine.stats()
            self.wake()

    async def on_output(self, out: RequestOutput) -> None:
        await self.publish_output(out)

    async def release(self, request_id: str) -> bool:
        before = len(self.pending)
        self.pending = deque((j, e) for j, e in self.pending if j.request.request_id != request_id)
        return len(self.pending) < before

    def leased_blocks(self) -> int:
        return sum(export.meta.num_blocks for _, export in self.pending)

    async def fail_running(self, why: str) -> None:
        self.pending.clear()
        await self.fail_all(why)
