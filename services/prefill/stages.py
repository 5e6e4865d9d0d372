"""Pipelined prefill (CPP, Mooncake FAST'25 §3.3) on a prefill instance: the stages of
groups it is part of (StageJob), each a range of the model's layers over a pool of its own.

A stage opens the prompt on its StageRunner (its prefix hit goes back in the reply) and
computes from the group's start. Stage 0 runs the prompt a chunk at a time; after each
chunk its hidden states are offered on the data plane and the next stage is told
(StageHop), which fetches them, acks, and runs its layers on them, and so on. Once a stage
has run the prompt's last chunk, its KV slice (its layers of every block) is offered for
decode and its handle travels on with the last hop. The last stage samples the first
token from its logits, streams it to the client, and gives decode a DecodeJob with every
stage's slice, which decode places layer by layer (handoff.fill_reserved_slice).

Every stage's compute runs on the instance's engine thread, between engine steps, so a
stage never competes with the instance's own prompts for its cores. A stage that fails
(a hop that does not come, a peer that is gone) ends the request with the retryable error
the gateway places again on.

Not yet: pipelined prompts do not take logprobs, prompt logprobs or structured output (a
StageJob asking for them is refused by name, and the conductor does not send one); the
slices go to decode after the last chunk, not streamed while the prompt runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import torch
from nats.aio.msg import Msg

from services.prefill.stage_run import Host, StageRun, unsupported
from services.worker.instance import Stream
from shared import bus, errors, subjects
from shared.engine.engine_types import RequestOutput
from shared.engine.hidden import HiddenChunk
from shared.engine.logits import RowContext
from shared.engine.output import OutputTracker, make_detokenizer
from shared.engine.params import SamplingParams
from shared.engine.sampling import sample
from shared.engine.stage import NoRoom, StageRunner
from shared.messages import (
    Ack,
    DecodeJob,
    GenerateRequest,
    KVEvent,
    KVEventKind,
    KVHandle,
    StageClose,
    StageHop,
    StageJob,
    StageOpened,
)
from shared.transfer import TransferFailed
from shared.transfer.base import HANDOFF, HOP

log = logging.getLogger(__name__)


class Stages:
    def __init__(self, inst: Host, kv_cache_bytes: int) -> None:
        self.inst = inst
        self.kv_cache_bytes = kv_cache_bytes
        self.runners: dict[tuple[int, int], StageRunner] = {}
        self.runs: dict[str, StageRun] = {}
        # The group holder ids each runner's blocks were published under: an eviction is
        # news to every one of them (a runner serves every group with its layer range).
        self.holders: dict[tuple[int, int], set[str]] = {}

    def _runner(self, layers: tuple[int, int]) -> StageRunner:
        """Engine thread: the runner for `layers`, its pool made on first use."""
        runner = self.runners.get(layers)
        if runner is None:
            config = replace(self.inst.settings.engine_config(), kv_cache_bytes=self.kv_cache_bytes)
            runner = StageRunner(self.inst.lm, config, layers)
            self.runners[layers] = runner
        return runner

    # -- a StageJob: open the prompt ------------------------------------------------------
    async def on_stage(self, msg: Msg) -> None:
        try:
            job = StageJob.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad stage job: {exc}"))
            return
        rid = job.request.request_id
        refused = self._refusal(job)
        if refused is not None:
            await bus.respond(msg, refused)
            return
        layers = (job.me.first_layer, job.me.end_layer)
        if layers not in self.runners:
            await self._open_unbuilt(msg, job)
            return
        runner = self.runners[layers]
        try:
            hit = await self.inst.run_engine(runner.open, rid, job.request.prompt_token_ids)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(str(exc)))
            return
        if hit < job.start_tokens:
            await self.inst.run_engine(runner.close, rid)
            await bus.respond(
                msg,
                errors.Rejected(
                    f"stage holds {hit} of the group's {job.start_tokens} cached tokens",
                    retry_after_s=0.0,
                ),
            )
            return
        await self.inst.run_engine(runner.rewind, rid, job.start_tokens)
        run = StageRun(job, runner)
        self.runs[rid] = run
        if job.last:  # it streams the first token: the client's events start here
            self.inst.streams[rid] = Stream(job.request, 0, job.start_tokens)
        await bus.respond(msg, StageOpened(hit_tokens=hit))
        run.task = asyncio.create_task(self._drive(run))

    async def _open_unbuilt(self, msg: Msg, job: StageJob) -> None:
        """The first prompt for a layer range: its pool and packed weights take seconds
        to build on a small machine, longer than a conductor waits for an answer. So the
        stage answers at once (it holds nothing cached yet) and builds them in the run,
        before its first chunk; hops that come meanwhile queue."""
        rid = job.request.request_id
        if job.start_tokens:
            await bus.respond(
                msg,
                errors.Rejected(
                    f"stage holds 0 of the group's {job.start_tokens} cached tokens",
                    retry_after_s=0.0,
                ),
            )
            return
        run = StageRun(job, None)
        self.runs[rid] = run
        if job.last:
            self.inst.streams[rid] = Stream(job.request, 0, 0)
        await bus.respond(msg, StageOpened(hit_tokens=0))
        run.task = asyncio.create_task(self._drive(run))

    async def _build(self, run: StageRun) -> None:
        """A run opened before its runner existed: build it, then open the prompt."""
        job = run.job
        layers = (job.me.first_layer, job.me.end_layer)
        runner = await self.inst.run_engine(self._runner, layers)
        await self.inst.run_engine(
            runner.open, job.request.request_id, job.request.prompt_token_ids
        )
        run.runner = runner

    def _refusal(self, job: StageJob) -> errors.HalfmoonError | None:
        rid = job.request.request_id
        if not self.inst.intake_open:
            return errors.Unavailable("this instance is switching role", code="switching")
        if self.kv_cache_bytes <= 0:
            return errors.Rejected("this instance runs no pipeline stages (stage_kv_gb 0)")
        if job.me.instance_id != self.inst.instance_id:
            return errors.InvalidRequest(f"stage {job.index} is {job.me.instance_id}, not here")
        if job.stages[-1].end_layer != self.inst.lm.num_layers:
            return errors.InvalidRequest(
                f"the stages end at layer {job.stages[-1].end_layer}; "
                f"the model has {self.inst.lm.num_layers}"
            )
        if rid in self.runs or self.inst.known(rid):
            return errors.InvalidRequest(f"request {rid} is already here")
        prompt = len(job.request.prompt_token_ids)
        block = self.inst.settings.block_size
        if job.start_tokens >= prompt or job.start_tokens % block:
            return errors.InvalidRequest(
                f"start_tokens {job.start_tokens}: a multiple of {block} below the "
                f"prompt's {prompt} tokens"
            )
        missing = unsupported(job)
        if missing:
            return errors.InvalidRequest(f"a pipelined prefill does not take {missing} yet")
        return None

    # -- the chunks ------------------------------------------------------------------------
    async def _drive(self, run: StageRun) -> None:
        rid = run.job.request.request_id
        try:
            if run.runner is None:
                await self._build(run)
            await self._chunks(run)
        except (errors.HalfmoonError, TransferFailed, TimeoutError, ValueError, NoRoom) as exc:
            # A peer gone, a hop refused or late, no room: the gateway places it again. The
            # last stage tells the client (a stage before it fails there by a late hop).
            log.warning("request %s: stage %d failed (%s)", rid, run.job.index, exc)
            if run.slice is not None:  # nobody will fetch it now
                await self.inst.sender.withdraw(run.slice.transfer_id)
            if run.job.last:
                await self.inst.finish_with_error(rid, "unavailable", f"pipelined prefill: {exc}")
        finally:
            self.runs.pop(rid, None)
            if run.job.last and rid not in self.inst.finished:  # closed, or failed
                self.inst.streams.pop(rid, None)
            if run.runner is not None:
                await self.inst.run_engine(run.runner.close, rid)

    async def _chunks(self, run: StageRun) -> None:
        rid, chunk = run.job.request.request_id, self.inst.settings.chunk_tokens
        seq = run.built.seqs[rid]
        timeout = self.inst.settings.transfer_timeout_s
        while seq.num_uncomputed_tokens > 0:
            if run.job.index == 0:
                n, slices = min(chunk, seq.num_uncomputed_tokens), list[KVHandle]()
                out = await self.inst.run_engine(run.built.run, rid, n)
            else:
                async with asyncio.timeout(timeout):
                    hop, slices = await run.hops.get()
                out = await self.inst.run_engine(run.built.run_hop, rid, hop.meta.num_tokens, hop)
            await self._publish_blocks(run)
            if seq.num_uncomputed_tokens == 0:  # the prompt's last chunk: my slice too
                slices = [*slices, await self._offer_slice(run)]
            if run.job.last:
                if seq.num_uncomputed_tokens == 0:
                    await self._first_token(run, out, slices)
            else:
                await self._pass_on(run, out, slices)

    async def _publish_blocks(self, run: StageRun) -> None:
        """The stage's new full blocks (and evictions) as KV events under the group's
        holder id, so the conductor sees the prefix the group holds, layer range by layer
        range. A stage that lost a block the index still credits refuses a job that
        counts on it (on_stage), and the conductor decides again."""
        stored, evicted = await self.inst.run_engine(run.built.blocks.drain_events)
        holders = self.holders.setdefault(run.built.layers, set())
        holders.add(run.holder)
        nbytes = run.built.kv.shape.block_nbytes
        events = [(KVEventKind.STORED, run.holder, stored)] + [
            (KVEventKind.REMOVED, h, evicted) for h in sorted(holders)
        ]
        for kind, holder, hashes in events:
            if hashes:
                event = KVEvent(
                    kind=kind,
                    instance_id=holder,
                    block_hashes=hashes,
                    block_nbytes=nbytes,
                    sent_at=time.time(),
                )
                await self.inst.nc.publish(subjects.KV_EVENTS, event.encode())

    async def _offer_slice(self, run: StageRun) -> KVHandle:
        rid = run.job.request.request_id
        export = await self.inst.run_engine(run.built.export, rid)
        run.slice = await self.inst.offers.offer(HANDOFF, export)
        return run.slice

    async def _pass_on(self, run: StageRun, out: torch.Tensor, slices: list[KVHandle]) -> None:
        """The chunk's hidden states to the next stage, acked once it has them."""
        rid = run.job.request.request_id
        chunk = run.built.hop(rid, out)
        handle = await self.inst.sender.offer_off_loop(
            HOP,
            chunk.meta.model_dump_json().encode(),
            chunk.payload(),
            chunk.meta.num_tokens,
            ttl_s=self.inst.settings.transfer_timeout_s,
        )
        nxt = run.job.stages[run.job.index + 1].instance_id
        try:
            await bus.request(
                self.inst.nc,
                subjects.prefill_hop(nxt),
                StageHop(request_id=rid, hidden=handle, slices=slices),
                Ack,
                timeout_s=self.inst.settings.transfer_timeout_s,
            )
        except errors.HalfmoonError:
            await self.inst.sender.withdraw(handle.transfer_id)
            raise

    # -- a hop from the stage before --------------------------------------------------------
    async def on_hop(self, msg: Msg) -> None:
        try:
            hop = StageHop.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad stage hop: {exc}"))
            return
        run = self.runs.get(hop.request_id)
        if run is None or run.job.index == 0:
            await bus.respond(msg, errors.Rejected(f"no stage of {hop.request_id} takes hops here"))
            return
        try:
            meta, payload = await self.inst.receiver.fetch(
                hop.hidden, self.inst.settings.transfer_timeout_s, HOP
            )
            chunk = HiddenChunk.from_bytes(meta, payload)
        except (TransferFailed, ValueError) as exc:
            await bus.respond(msg, errors.Rejected(f"hidden states not fetched: {exc}"))
            return
        run.hops.put_nowait((chunk, hop.slices))
        await bus.respond(msg, Ack())

    # -- the last stage: the first token, and decode ----------------------------------------
    async def _first_token(
        self, run: StageRun, logits: torch.Tensor, slices: list[KVHandle]
    ) -> None:
        req = run.job.request
        rid = req.request_id
        stream = self.inst.streams.get(rid)
        if stream is None:  # cancelled meanwhile
            return
        produced = time.time()
        token, tracker = self._sample(req, logits)
        step = tracker.append(token)
        out = RequestOutput(
            rid,
            [token],
            step.text,
            step.finish_reason,
            len(req.prompt_token_ids),
            1,
            run.job.start_tokens,
        )
        await self.inst.publish_output(out)
        if step.finish_reason is not None:  # it ended at its first token: decode has nothing
            for handle in slices:
                await self.inst.sender.withdraw(handle.transfer_id)
            return
        self.inst.streams.pop(rid, None)
        self.inst.finished.add(rid)
        job = DecodeJob(
            request=req,
            prefill_id=self.inst.instance_id,
            kv=None,
            kv_slices=slices,
            output_token_ids=[token],
            emitted_text=tracker.emitted_text,
            events_sent=stream.next_index,
            cached_tokens=run.job.start_tokens,
            first_token_time=produced,
        )
        try:
            await bus.request(
                self.inst.nc, subjects.decode_submit(run.job.decode_id), job, Ack, timeout_s=5.0
            )
        except errors.HalfmoonError as exc:
            for handle in slices:
                await self.inst.sender.withdraw(handle.transfer_id)
            await self.inst.finish_with_error(
                rid,
                exc.code,
                f"decode {run.job.decode_id} did not take the request: {exc.message}",
                stream,
            )

    def _sample(self, req: GenerateRequest, logits: torch.Tensor) -> tuple[int, OutputTracker]:
        """The first token, drawn as the engine draws it, and the tracker that turns it
        into text and says whether the request ends there."""
        lm, prompt = self.inst.lm, list(req.prompt_token_ids)
        params = SamplingParams.of(req.sampling)
        tracker = OutputTracker(
            params,
            make_detokenizer(lm.tokenizer, prompt, params.skip_special_tokens),
            lm.eos_token_ids,
            len(prompt),
            lm.max_model_len,
        )
        stops = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else lm.eos_token_ids
        )
        row = RowContext(params, 0, prompt, len(prompt), stops)
        return sample(logits, [row]).tokens[0], tracker

    async def on_close(self, msg: Msg) -> None:
        """The conductor's StageClose: another stage of the group refused, so the request
        goes elsewhere. This stage lets go of it (answered once it has), without ending
        it as a cancel would."""
        try:
            close = StageClose.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad stage close: {exc}"))
            return
        await self.release(close.request_id)
        await bus.respond(msg, Ack())

    async def release(self, request_id: str) -> None:
        """A cancel: the stage stops; its blocks stay cached."""
        run = self.runs.get(request_id)
        if run is not None and run.task is not None:
            run.task.cancel()
            await asyncio.wait({run.task})  # its blocks and stream let go
