"""Decode: fetch each request's KV from its prefill instance, then step every running
sequence in turn on the engine thread, publishing each token as it is produced."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from transformers import DynamicCache

from shared import bus, errors
from shared.engine.instance import EngineInstance
from shared.engine.kv_codec import KVMeta
from shared.engine.output import OutputTracker
from shared.engine.runner import LoadedModel
from shared.engine.sampling import Sampler
from shared.messages import Ack, DecodeJob, KVEventKind, Role
from shared.transfer import KVReceiver, TransferFailed
from services.decode.args import DecodeSettings

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    job: DecodeJob
    cache: DynamicCache
    tracker: OutputTracker
    sampler: Sampler
    next_index: int

    @property
    def request_id(self) -> str:
        return self.job.request.request_id


class DecodeInstance(EngineInstance):
    role = Role.DECODE

    def __init__(self, settings: DecodeSettings, nc: NATS, lm: LoadedModel,
                 receiver: KVReceiver) -> None:
        super().__init__(settings, nc, lm)
        self.settings: DecodeSettings = settings
        self.receiver = receiver
        self.active: dict[str, Sequence] = {}
        self._wake = asyncio.Event()
        self._admissions: set[asyncio.Task] = set()

    async def on_submit(self, msg: Msg) -> None:
        try:
            job = DecodeJob.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad decode job: {exc}"))
            return
        if len(self.active) + len(self._admissions) >= self.settings.max_running:
            await bus.respond(msg, errors.Rejected("decode instance is full", retry_after_s=1.0))
            return
        task = asyncio.create_task(self.admit(job))
        self._admissions.add(task)
        task.add_done_callback(self._admissions.discard)
        await bus.respond(msg, Ack())

    async def admit(self, job: DecodeJob) -> None:
        """Pull the KV from prefill and join the running batch."""
        req = job.request
        self.queue_depth += 1
        try:
            meta_bytes, payload = await self.receiver.fetch(job.kv, self.settings.transfer_timeout_s)
            meta = KVMeta.model_validate_json(meta_bytes)
            cache = await self.run_engine(self.runner.import_, meta, payload)
        except (TransferFailed, ValueError) as exc:
            await self.publish_error(req, job.events_sent, "kv_transfer_failed", str(exc))
            return
        finally:
            self.queue_depth -= 1
        if req.request_id in self.cancelled:
            return
        tracker = self.tracker(req)
        tracker.token_ids = list(job.output_token_ids)
        tracker.emitted_text = job.emitted_text
        self.active[req.request_id] = Sequence(job, cache, tracker, Sampler(req.sampling),
                                               job.events_sent)
        self.kv_tokens_used += meta.num_tokens
        await self.publish_kv(KVEventKind.STORED, req.block_hashes, self.block_nbytes())
        self._wake.set()

    async def serve(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._drop_cancelled()
            if not self.active:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.25)
                except asyncio.TimeoutError:
                    pass
                continue
            seqs = list(self.active.values())
            self.running = len(seqs)
            try:
                tokens = await self.run_engine(self._step_all, seqs)
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep the instance
                log.exception("decode step failed")
                for seq in seqs:
                    await self._finish(seq, error=f"decode failed: {type(exc).__name__}")
                continue
            for seq, token in zip(seqs, tokens):
                await self._emit(seq, token)
        self.running = 0

    def _step_all(self, seqs: list[Sequence]) -> list[int]:
        """One token for every running sequence (engine thread)."""
        out = []
        for seq in seqs:
            logits = self.runner.decode_step(seq.cache, seq.tracker.token_ids[-1])
            out.append(seq.sampler.sample(logits, len(seq.tracker.token_ids)))
        return out

    async def _emit(self, seq: Sequence, token: int) -> None:
        if seq.request_id in self.cancelled:
            await self._finish(seq)
            return
        out = seq.tracker.append(token)
        await self.publish_tokens(seq.job.request, seq.next_index, [token], out.text,
                                  out.finish_reason, seq.tracker)
        seq.next_index += 1
        if out.finish_reason is not None:
            await self._finish(seq)

    async def _finish(self, seq: Sequence, error: str | None = None) -> None:
        if self.active.pop(seq.request_id, None) is None:
            return
        if error:
            await self.publish_error(seq.job.request, seq.next_index, "internal_error", error)
        self.kv_tokens_used -= seq.job.kv.num_tokens
        await self.publish_kv(KVEventKind.REMOVED, seq.job.request.block_hashes,
                              self.block_nbytes())

    def _drop_cancelled(self) -> None:
        for rid in [rid for rid in self.active if rid in self.cancelled]:
            seq = self.active[rid]
            log.info("request %s cancelled during decode", rid)
            asyncio.get_running_loop().create_task(self._finish(seq))

    async def fail_running(self, why: str) -> None:
        for seq in list(self.active.values()):
            await self._finish(seq, error=why)
