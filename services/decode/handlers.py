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
        """Pull the KV from prefill (data plane), then join the batch when there is room."""
        req = job.request
        stream = Stream(req, job.events_sent, job.cached_tokens)
        try:
            meta_bytes, payload = await self.receiver.fetch(job.kv, self.settings.transfer_timeout_s)
            export = KVExport.from_bytes(KVMeta.model_validate_json(meta_bytes), payload)
        except (TransferFailed, ValueError) as exc:
            await self.finish_with_error(req.request_id, "kv_transfer_failed", str(exc), stream)
            return
        if req.request_id in self.cancelled:
            return
        self.streams[req.request_id] = stream
        self.pending.append((job, export))
        self.wake()  # the engine loop admits it between steps (one admitter, no races)

    async def after_step(self) -> None:
        while self.pending:
            job, export = self.pending[0]
            req = job.request
            if req.request_id not in self.streams:  # cancelled while waiting
                self.pending.popleft()
                continue
            try:
                ok = await self.run_engine(self.engine.add_prefilled, req.request_id,
                                           req.prompt_token_ids, job.output_token_ids,
                                           req.sampling, export, job.emitted_text, req.tenant)
            except ValueError as exc:
                self.pending.popleft()
                await self.finish_with_error(req.request_id, "kv_transfer_failed", str(exc))
                continue
            if not ok:
                return  # the pool is full: try again after the next step
            self.pending.popleft()
            self._stats = self.engine.stats()
            self.wake()

    async def on_output(self, out: RequestOutput) -> None:
        await self.publish_output(out)

    async def fail_running(self, why: str) -> None:
        self.pending.clear()
        await self.fail_all(why)
