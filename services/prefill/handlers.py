"""Prefill: prompts through the engine (chunked, prefix-cached); the first token is
streamed, the prompt's KV is offered on the data plane and decode is told where it is.
A long prompt's KV goes to decode chunk by chunk while it is computed (kv_stream.py), so
its handoff carries only the last chunk's blocks; and before any KV is offered, decode says
which leading blocks of the prompt it caches already (decode-side reuse), which never move.

With no decode instance named in the job (colocated mode) the instance decodes too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.prefill.args import PrefillSettings
from services.prefill.decode_submit import submit_decode
from services.prefill.kv_stream import KVStreams, hold_at
from services.prefill.offers import KVOffers
from services.prefill.prefix_pull import pull_prefix, replicate
from services.prefill.stages import Stages
from services.prefill.streaming import Outgoing, worth_streaming
from services.worker.instance import EngineInstance, Stream
from shared import bus, errors
from shared.engine import omp
from shared.engine.kv_transfer import skip_blocks
from shared.engine.llm_engine import RequestOutput
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.handoff_messages import KVHold
from shared.kv_load import KVLoadError
from shared.kv_messages import KVReplicate
from shared.messages import (
    Ack,
    CostSample,
    DecodeJob,
    GenerateRequest,
    KVExportReply,
    KVExportRequest,
    PrefillJob,
    Role,
    TokenLogprob,
)
from shared.transfer import KVReceiver, KVSender
from shared.transfer.base import HANDOFF, PREFIX

log = logging.getLogger(__name__)


class PrefillInstance(EngineInstance):
    role = Role.PREFILL

    def __init__(
        self,
        settings: PrefillSettings,
        nc: NATS,
        lm: LoadedModel,
        sender: KVSender,
        receiver: KVReceiver,
        before: EngineInstance | None = None,
    ) -> None:
        super().__init__(settings, nc, lm, before)
        self.settings: PrefillSettings = settings
        self.sender = sender
        self.receiver = receiver
        self.decode_for: dict[str, str] = {}
        self._transfers: set[asyncio.Task] = set()
        self._handing_off: set[asyncio.Task] = set()
        self.exporter = omp.serial_executor("kv-export")  # beside the step, no team (omp.py)
        self.offers = KVOffers(
            sender, settings.transfer_timeout_s, lambda nbytes: self.count_transfer(False, nbytes)
        )
        # Jobs acknowledged and not in the engine yet (request id -> prompt tokens). Adding
        # waits for the engine thread, up to a whole step: an fp32 prefill chunk on an
        # AVX2 CPU takes a second, and three jobs came in meanwhile. The stats a heartbeat
        # carries date from the step's start, so without these the conductor, which drops
        # what it sent at each heartbeat, lost them from the queue and admitted requests
        # at half their real TTFT.
        self.intake: dict[str, int] = {}
        self.kv_streams = KVStreams(self)  # long prompts whose KV streams to decode
        self.stages = Stages(self, int(settings.stage_kv_gb * 2**30))  # pipelined prefill

    def connector(self) -> PrefillInstance:
        return self  # hands_off: the requests a decode instance was named for

    def hands_off(self, request_id: str) -> bool:
        """Engine thread: the KV leaves once the first token exists, unless this instance
        decodes the request too (colocated: no decode instance named in its job)."""
        return bool(self.decode_for.get(request_id))

    def streamed_blocks(self, request_id: str) -> int:
        """Engine thread: decode has these leading blocks already (acked chunks)."""
        return self.kv_streams.acked(request_id)

    async def on_submit(self, msg: Msg) -> None:
        try:
            job = PrefillJob.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad prefill job: {exc}"))
            return
        req = job.request
        rid = req.request_id
        if self.known(rid):  # nothing (more) to do
            await bus.respond(msg, Ack())
            return
        if not self.intake_open:  # switching role: the conductor places it elsewhere
            await bus.respond(
                msg, errors.Unavailable("this instance is switching role", code="switching")
            )
            return
        if self._stats.waiting + len(self.intake) >= self.settings.max_queue:
            await bus.respond(msg, errors.Rejected("prefill queue is full", retry_after_s=1.0))
            return
        self.streams[req.request_id] = Stream(req, 0)
        self.decode_for[req.request_id] = job.decode_id
        self.intake[rid] = len(req.prompt_token_ids)
        if (
            job.decode_id
            and self.settings.stream_handoff
            and worth_streaming(req, self.settings.chunk_tokens)
        ):
            self.kv_streams.start(rid, job.decode_id, req)
        await bus.respond(msg, Ack())
        if req.arrival_time > 0:  # the way in, for the cost model's overhead_s
            self.engine.cost_samples.append(
                CostSample(
                    kind="dispatch",
                    tokens=len(req.prompt_token_ids),
                    context=0.0,
                    seconds=max(0.0, time.time() - req.arrival_time),
                )
            )
        # Adding waits for the engine thread (up to a step): do it off this callback so the
        # next job is acknowledged at once.
        pull = job.prefix_from and job.prefix_from != self.instance_id and job.prefix_blocks > 0
        task = asyncio.create_task(self._pull_then_add(job) if pull else self._add(job))
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def _add(self, job: PrefillJob) -> None:
        req = job.request
        try:
            if req.request_id not in self.streams:  # cancelled meanwhile
                return
            if req.prompt_logprobs is not None:
                await self._score_prompt(req)
            await self.run_engine(
                self.engine.add_request,
                req.request_id,
                req.prompt_token_ids,
                SamplingParams.of(req.sampling),
                req.tenant,
                not job.skip_disk,
            )
            self.refresh_stats()  # the engine's stats show it from here on
        except ValueError as exc:
            self.decode_for.pop(req.request_id, None)
            await self.finish_with_error(req.request_id, "invalid_request", str(exc))
            return
        except KVLoadError as exc:  # a disk block failed, and the policy is "fail"
            await self._fail_load(req.request_id, str(exc))
            return
        finally:
            self.intake.pop(req.request_id, None)  # no await since the stats took it in
        self.wake()

    async def _score_prompt(self, req: GenerateRequest) -> None:
        """Every prompt position's logprob (echo): a teacher-forced pass of its own, since
        positions served from the prefix cache have no logits. Sent with the first token."""
        k = req.prompt_logprobs or 0
        scores = await self.run_engine(self.engine.prompt_logprobs, req.prompt_token_ids, k)
        stream = self.streams.get(req.request_id)
        if stream is None:
            return
        ids = req.prompt_token_ids[1:]
        stream.prompt_logprobs = [
            TokenLogprob(
                token_id=t,
                logprob=float(lp),
                top=list(zip(scores.top_ids[i].tolist(), scores.top_logprobs[i].tolist())),
            )
            for i, (t, lp) in enumerate(zip(ids, scores.token_logprobs.tolist()))
        ]

    async def _pull_then_add(self, job: PrefillJob) -> None:
        """Fetch the prefix blocks another instance holds; on a failure recompute them, or
        (the "fail" policy, shared/kv_load.py) end the request."""
        rid = job.request.request_id
        why = await pull_prefix(self, self.receiver, job)
        if why and self.engine.kv_load_failures.failed("pull"):
            self.intake.pop(rid, None)
            await self._fail_load(rid, why)
            return
        if why:
            log.warning("request %s: %s; recomputing", rid, why)
        await self._add(job)

    async def _fail_load(self, request_id: str, why: str) -> None:
        """The "fail" policy: the request ends here, before the engine runs it."""
        self.decode_for.pop(request_id, None)
        self.kv_streams.drop(request_id)
        await self.finish_with_error(request_id, errors.KVLoadFailed.code, why)

    async def on_export(self, msg: Msg) -> None:
        """Another instance wants our cached blocks of a prefix: offer them for a pull."""
        try:
            req = KVExportRequest.model_validate_json(msg.data)
            # Not on the engine thread: an export must not wait behind a prefill chunk
            # (the engine locks only its bookkeeping, not the forward pass).
            export = await asyncio.get_running_loop().run_in_executor(
                self.exporter, self.engine.export_prefix, req.block_hashes
            )
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad export request: {exc}"))
            return
        if export is None:
            await bus.respond(
                msg, errors.HalfmoonError("none of those blocks is cached here", code="not_cached")
            )
            return
        # The reply (over NATS, to the asking instance only) is the one place the new
        # transfer id, a single-use capability, goes.
        handle = await self.offers.offer(PREFIX, export)
        await bus.respond(msg, KVExportReply(handle=handle, num_blocks=export.meta.num_blocks))

    async def on_replicate(self, msg: Msg) -> None:
        """The conductor wants a hot prefix copied here (a publish: nobody waits)."""
        try:
            order = KVReplicate.model_validate_json(msg.data)
        except ValueError as exc:
            log.warning("malformed replicate order dropped: %s", exc)
            return
        task = asyncio.create_task(replicate(self, self.receiver, order))
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def after_step(self) -> None:
        await self.kv_streams.send_ready()

    async def _held_prefix(self, out: RequestOutput, req: GenerateRequest, decode_id: str) -> int:
        """Decode-side reuse at the handoff: the leading blocks of the prompt decode
        caches, pinned there for this request (0: none, reuse off, or no answer)."""
        if not self.settings.decode_reuse or out.handoff is None:
            return 0
        hold = KVHold(
            request=req,
            prefill_id=self.instance_id,
            output_token_ids=out.new_token_ids,
            num_kv_tokens=out.handoff.meta.num_tokens,
        )
        return await hold_at(self.nc, decode_id, hold, self.settings.hold_timeout_s) or 0

    async def on_output(self, out: RequestOutput) -> None:
        decode_id = self.decode_for.get(out.request_id, "")
        stream = self.streams.get(out.request_id)
        await self.publish_output(out)
        if out.finish_reason is not None or out.error is not None:
            self.decode_for.pop(out.request_id, None)
            await self.kv_streams.end(out.request_id)
        if out.handoff is None or stream is None:
            return
        streamed, in_flight = self.kv_streams.take(out.request_id)
        self.streams.pop(out.request_id, None)
        self.decode_for.pop(out.request_id, None)
        self.finished.add(out.request_id)
        # Beside the next step, not before it: offering the KV and waiting for decode's
        # ack took a median 6 ms and up to 130 ms a handoff under load, time the engine
        # sat idle with prompts queued.
        task = asyncio.create_task(
            self._hand_off(out, stream, decode_id, time.time(), streamed, in_flight)
        )
        self._handing_off.add(task)
        task.add_done_callback(self._handing_off.discard)

    async def _hand_off(
        self,
        out: RequestOutput,
        stream: Stream,
        decode_id: str,
        produced: float,
        streamed: Outgoing | None = None,
        in_flight: asyncio.Task | None = None,
    ) -> None:
        try:
            handoff = out.handoff
            assert handoff is not None
            if in_flight is not None:
                # A chunk was still on its way when the first token came, and the export
                # above starts where decode's acks stood then. Its answer comes within the
                # transfer timeout (_send_chunk never raises); once acked, its blocks are
                # not sent a second time.
                await asyncio.wait({in_flight})
            if streamed is not None and streamed.opened:
                held = streamed.acked
            else:
                held = await self._held_prefix(out, stream.request, decode_id)
            # At least one block moves: a prompt decode holds whole is still a handoff.
            held = min(held, handoff.meta.first_block + handoff.meta.num_blocks - 1)
            if held > handoff.meta.first_block:
                handoff = skip_blocks(handoff, held - handoff.meta.first_block)
            await self._offer_and_submit(replace(out, handoff=handoff), stream, decode_id, produced)
        except Exception as exc:
            log.exception("request %s: handoff failed", stream.request.request_id)
            await self.finish_with_error(
                stream.request.request_id, "internal_error", f"handoff failed: {exc}", stream
            )

    async def _offer_and_submit(
        self, out: RequestOutput, stream: Stream, decode_id: str, produced: float
    ) -> None:
        """Offer the prompt's KV on the data plane and give decode the job. `produced`: when
        the step made the first token, where decode's handoff sample starts (the offer's
        copy is part of what a handoff takes)."""
        assert out.handoff is not None
        req = stream.request
        # The transfer id is the sender's, not the request id clients see: only the decode
        # job below (over NATS) carries it.
        handle = await self.offers.offer(HANDOFF, out.handoff, req.request_id)
        tid = handle.transfer_id
        if req.request_id in self.cancelled:  # while the offer was being written
            await self.sender.withdraw(tid)
            return
        job = DecodeJob(
            request=req,
            prefill_id=self.instance_id,
            kv=handle,
            output_token_ids=out.new_token_ids,
            emitted_text=out.text,
            events_sent=stream.next_index,
            cached_tokens=out.num_cached_tokens,
            first_token_time=produced,
            held_blocks=out.handoff.meta.first_block,
        )
        refused = await submit_decode(self.nc, job, decode_id)
        if refused is not None:
            await self.sender.withdraw(tid)  # nobody will fetch it
            await self.finish_with_error(req.request_id, refused.code, refused.message, stream)

    async def fail_waiting(self, why: str) -> None:
        """On shutdown, handoffs under way finish; requests not handed off end with a
        clear error."""
        await asyncio.gather(*self._handing_off, return_exceptions=True)
        for rid in list(self.streams):
            await self.abort(rid)
            await self.finish_with_error(rid, "unavailable", why)

    def intake_prompts(self) -> list[int]:
        return list(self.intake.values())

    def holds(self) -> str:
        held = [
            f"{n} {what}"
            for n, what in (
                (len(self.intake), "jobs not in the engine yet"),
                (len(self._transfers), "prefix pulls and replicas"),
                (len(self.kv_streams.tasks), "KV chunks"),
                (len(self._handing_off), "handoffs"),
                (len(self.stages.runs), "pipeline stages"),
                (self.sender.pending, "KV offers not fetched"),
            )
            if n
        ]
        return ", ".join([h for h in [super().holds(), *held] if h])

    def close_role(self) -> None:
        self.exporter.shutdown(wait=True, cancel_futures=True)

    async def release(self, request_id: str) -> bool:
        await self.stages.release(request_id)
        self.intake.pop(request_id, None)
        self.kv_streams.drop(request_id)  # decode got the same cancel
        self.decode_for.pop(request_id, None)
        return await self.offers.withdraw_handoff(request_id)

    def leased_blocks(self) -> int:
        return self.offers.leased_blocks()
