"""What prefill and decode instances share: the engine thread and the bus side.

Torch runs on one dedicated thread per instance, so the asyncio loop keeps answering
heartbeats, cancels and transfers while a step is in flight. Every engine call (adding,
aborting, stepping) goes through that one thread, which serializes them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, TypeVar

from nats.aio.client import Client as NATS

from services.worker.settings import WorkerSettings
from shared import aio, subjects
from shared.engine import cpu, omp
from shared.engine.connector import KVConnector
from shared.engine.llm_engine import EngineStats, LLMEngine, RequestOutput, StepTime
from shared.engine.runner import LoadedModel
from shared.messages import (
    CancelRequest,
    CostSample,
    ErrorBody,
    FinishReason,
    GenerateRequest,
    InstanceInfo,
    KVActivity,
    KVEvent,
    KVEventKind,
    Role,
    TokenEvent,
    TokenLogprob,
    Usage,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class CancelSet:
    """Request ids seen recently (cancelled, or ended); old entries age out so the set stays
    small."""

    def __init__(self, ttl_s: float = 600.0) -> None:
        self._ids: dict[str, float] = {}
        self._ttl = ttl_s

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._ids[request_id] = now
        if len(self._ids) > 10_000:
            self._ids = {k: t for k, t in self._ids.items() if now - t < self._ttl}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids


@dataclass
class Stream:
    """Where a request's next token event goes, and what its final usage says."""

    request: GenerateRequest
    next_index: int
    # Prompt tokens the instance that computed the prompt found in its prefix cache. None:
    # this instance computes it, and its own engine says. (Decode's own prefix match on a
    # handed-off prompt saves a copy, not compute: it is not what usage reports.)
    cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # scored before prefill, sent first
    # A handoff's KV bytes fetched here and prompt tokens held here already (decode-side
    # reuse), sent with the next event for the request's record.
    handoff_bytes: int | None = None
    handoff_held_tokens: int | None = None


class EngineInstance:
    role: Role
    started_at: float
    cancelled: CancelSet
    finished: CancelSet  # ended here (finished, failed or handed on): a job again is a duplicate
    engine: LLMEngine
    kv_activity: KVActivity  # cumulative, sent with every heartbeat
    _engine_thread: ThreadPoolExecutor

    def __init__(
        self,
        settings: WorkerSettings,
        nc: NATS,
        lm: LoadedModel,
        before: EngineInstance | None = None,
    ) -> None:
        """`before`: the instance this one takes over from in a role switch (roles.py). Its
        engine (weights, KV pool, prefix cache), engine thread and bookkeeping carry over;
        only what the role does with them is new."""
        self.settings = settings
        self.nc = nc
        self.lm = lm
        self.instance_id = settings.instance_id
        self.streams: dict[str, Stream] = {}
        self.kv_port = 0
        self._wake = asyncio.Event()
        # False once a role switch began: new work is refused (the conductor or the prefill
        # that sent it places it elsewhere), what is here finishes.
        self.intake_open = True
        if before is not None:
            self.started_at, self.cancelled, self.finished = (
                before.started_at,
                before.cancelled,
                before.finished,
            )
            self._engine_thread, self.engine = before._engine_thread, before.engine
            self.engine.connector = self.connector()
            self.kv_activity = before.kv_activity
        else:
            self.started_at, self.cancelled, self.finished = time.time(), CancelSet(), CancelSet()
            # Every step runs on this thread, the process's one OpenMP team (omp.py).
            self._engine_thread = omp.engine_executor(settings.threads)
            self.engine = self._engine_thread.submit(  # its KV pool filled by the team
                LLMEngine, lm, settings.engine_config(), connector=self.connector()
            ).result()
            self.kv_activity = KVActivity()
        self._stats = self.engine.stats()
        # What the conductor's cost-model prior must match (see calibration.py).
        threads = self._engine_thread.submit(omp.team_size).result()  # the steps' threads
        dtype = str(lm.dtype).removeprefix("torch.")
        self._engine_key = cpu.engine_key(lm.name, dtype, settings.quantization, threads)

    def connector(self) -> KVConnector | None:
        """What the engine asks where each request's KV goes (None: it decodes them all)."""
        return None

    async def run_engine(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    def close_role(self) -> None:
        """What this role alone holds (threads of its own), at a switch or at shutdown; the
        engine and its thread stay for the next role."""

    def close_engine(self) -> None:
        self.close_role()
        self._engine_thread.shutdown(wait=True, cancel_futures=True)

    def wake(self) -> None:
        self._wake.set()

    def refresh_stats(self) -> None:
        """Off a step (a reservation, an import, an abort): heartbeats show it at once."""
        self._stats = self.engine.stats()

    @property
    def stats(self) -> EngineStats:
        """The engine's state as of the last step, addition or abort (a snapshot taken on
        the engine thread: safe to read from the loop or a metrics scrape)."""
        return self._stats

    def info(self) -> InstanceInfo:
        s = self._stats
        intake = self.intake_prompts()
        used = s.kv_blocks_total - s.kv_blocks_free
        disk_used, disk_free = self.disk_blocks()
        return InstanceInfo(
            instance_id=self.instance_id,
            role=self.role,
            pid=os.getpid(),
            started_at=self.started_at,
            kv_host=self.settings.kv_advertise_host or self.settings.kv_host,
            kv_port=self.kv_port,
            queue_depth=s.waiting + len(intake),
            running=s.running,
            kv_tokens_used=used * self.settings.block_size,
            model=self.lm.name,
            queue_prompts=[*s.queue_prompts, *intake][:256],
            mean_context=s.mean_context,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free,
            kv_blocks_cached=s.kv_blocks_cached,
            disk_blocks_used=disk_used,
            disk_blocks_free=disk_free,
            kv_activity=self.kv_activity,
            kv_blocks_leased=self.leased_blocks(),
            engine_key=self._engine_key,
            work_cpu_s=self.engine.work_cpu_s,
        )

    def heartbeat(self) -> InstanceInfo:
        """info(), plus the cost samples of work done since the previous heartbeat."""
        samples: list[CostSample] = []
        while self.engine.cost_samples and len(samples) < 64:
            samples.append(self.engine.cost_samples.popleft())
        return self.info().model_copy(update={"cost_samples": samples})

    def holds(self) -> str:
        """What this instance still has to finish before its role can change ("" when
        nothing): what the engine runs here; subclasses add their own (transfers, queues)."""
        s = self._stats
        if self.streams or self.engine.has_work():
            return f"{len(self.streams)} requests ({s.running} running, {s.waiting} waiting)"
        return ""

    def refuse_intake(self) -> None:
        """A role switch began: refuse new work from here on (see intake_open)."""
        self.intake_open = False

    def leased_blocks(self) -> int:
        """Blocks' worth of KV held outside the pool for requests (subclasses that hold any)."""
        return 0

    def intake_prompts(self) -> list[int]:
        """Prompt tokens of the jobs accepted but not in the engine yet (subclasses that
        take jobs): the engine's stats cannot show them, and the conductor, which forgets
        what it sent at each heartbeat, must still see them queued."""
        return []

    def disk_blocks(self) -> tuple[int, int]:
        """(used, free) blocks of the disk tier; (0, 0) without one."""
        disk = self.engine.disk
        if disk is None:
            return 0, 0
        used = len(disk)
        # Block files are all about one size: free room in blocks of the size seen so far.
        size = disk.nbytes / used if used else self.engine.kv.shape.block_nbytes
        return used, int(max(disk.capacity_bytes - disk.nbytes, 0) // max(size, 1))

    def count_transfer(self, incoming: bool, nbytes: int) -> None:
        """One KV transfer done, fetched by this instance (incoming) or from it."""
        a = self.kv_activity
        if incoming:
            a.transfers_in += 1
            a.bytes_in += nbytes
        else:
            a.transfers_out += 1
            a.bytes_out += nbytes

    # -- the engine loop ----------------------------------------------------------------
    async def serve(self, stop: asyncio.Event) -> None:
        """Step while there is work; sleep on the wake event otherwise. What the loop does
        between two steps (publishing, admitting) goes to the next step's cost, unless the
        instance waited for work in between (engine.step's `between`)."""
        since: StepTime | None = None  # (perf_counter, thread_time) at the last step's end
        while not stop.is_set():
            await self.after_step()
            if not self.engine.has_work():
                since = None
                self._wake.clear()
                await aio.wait_set(self._wake, 0.25)
                continue
            between = (
                StepTime(time.perf_counter() - since.wall_s, time.thread_time() - since.cpu_s)
                if since is not None
                else None
            )
            try:
                outputs = await self.run_engine(self.engine.step, between)
            except Exception:  # fail what ran, keep the instance alive
                log.exception("engine step failed")
                await self.fail_all("engine step failed")
                since = None
                continue
            since = StepTime(time.perf_counter(), time.thread_time())
            self._stats = self.engine.stats()
            await self.publish_kv_events()
            for out in outputs:
                await self.on_output(out)

    async def on_output(self, out: RequestOutput) -> None:
        raise NotImplementedError

    async def after_step(self) -> None:
        """Hook run between steps (decode admits imports that waited for room)."""

    async def fail_all(self, why: str) -> None:
        for rid in list(self.streams):
            await self.abort(rid)
            await self.finish_with_error(rid, "internal_error", why)

    # -- cancellation ---------------------------------------------------------------------
    def known(self, request_id: str) -> bool:
        """Cancelled, ended or in progress here: a job for it again is one to drop (the
        client left first, or a publish buffered across a NATS restart came twice)."""
        return (
            request_id in self.cancelled
            or request_id in self.finished
            or request_id in self.streams
        )

    async def on_cancel(self, msg: Any) -> None:
        try:
            req = CancelRequest.model_validate_json(msg.data)
        except ValueError:
            log.warning("malformed cancel dropped")
            return
        self.cancelled.add(req.request_id)
        held = self.streams.pop(req.request_id, None) is not None
        if held:
            await self.abort(req.request_id)
        if await self.release(req.request_id) or held:
            log.info("request %s cancelled (%s)", req.request_id, req.reason)

    async def abort(self, request_id: str) -> None:
        """Drop a request from the engine (its blocks go back to the pool) and refresh the
        stats heartbeats carry: with no work left, no step would refresh them."""

        def run() -> EngineStats:
            self.engine.abort(request_id)
            return self.engine.stats()

        self._stats = await self.run_engine(run)

    async def release(self, request_id: str) -> bool:
        """Free what this instance holds for a cancelled request outside the engine (transfer
        offers, jobs waiting for room); True if it held something. Subclasses extend it."""
        return False

    # -- publishing -----------------------------------------------------------------------
    async def publish_output(self, out: RequestOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        if out.error is not None:
            await self.finish_with_error(out.request_id, "internal_error", out.error)
            return
        usage = None
        if out.finish_reason is not None:
            usage = Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=(
                    out.num_cached_tokens if stream.cached_tokens is None else stream.cached_tokens
                ),
            )
            self.streams.pop(out.request_id)
            self.finished.add(out.request_id)
        logprobs = (
            None
            if out.logprobs is None
            else [
                TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top))
                for lp in out.logprobs
            ]
        )
        prompt_lps, stream.prompt_logprobs = stream.prompt_logprobs, None  # the first event
        moved, held = stream.handoff_bytes, stream.handoff_held_tokens
        stream.handoff_bytes = stream.handoff_held_tokens = None
        event = TokenEvent(
            request_id=out.request_id,
            index=stream.next_index,
            token_ids=out.new_token_ids,
            text=out.text,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            finish_reason=out.finish_reason,
            usage=usage,
            instance_id=self.instance_id,
            sent_at=time.time(),
            handoff_bytes=moved,
            handoff_held_tokens=held,
        )
        stream.next_index += 1
        await self.nc.publish(subjects.tokens(out.request_id), event.encode())

    async def finish_with_error(
        self, request_id: str, code: str, message: str, stream: Stream | None = None
    ) -> None:
        stream = stream or self.streams.pop(request_id, None)
        if stream is None:
            return
        self.streams.pop(request_id, None)
        self.finished.add(request_id)
        log.error("request %s failed: %s", request_id, message)
        event = TokenEvent(
            request_id=request_id,
            index=stream.next_index,
            finish_reason=FinishReason.ERROR,
            instance_id=self.instance_id,
            error=ErrorBody(code=code, message=message),
            sent_at=time.time(),
        )
        await self.nc.publish(subjects.tokens(request_id), event.encode())

    async def publish_kv_events(self) -> None:
        step = self.engine.last_step
        a = self.kv_activity
        a.blocks_stored += len(step.kv_stored)
        a.blocks_evicted += len(step.kv_evicted)
        a.disk_stored += len(step.disk_stored)
        a.disk_removed += len(step.disk_removed)
        changes: list[tuple[KVEventKind, Literal["dram", "disk"], list[int]]] = [
            (KVEventKind.STORED, "dram", step.kv_stored),
            (KVEventKind.REMOVED, "dram", step.kv_evicted),
            (KVEventKind.STORED, "disk", step.disk_stored),
            (KVEventKind.REMOVED, "disk", step.disk_removed),
        ]
        await self._publish_kv(changes)

    async def publish_dram_changes(self) -> None:
        """Blocks stored or evicted off the step loop (a replica imported into an idle
        engine), published now: the next step, which would publish them, may be far off."""
        stored, evicted = await self.run_engine(self.engine.blocks.drain_events)
        self.kv_activity.blocks_stored += len(stored)
        self.kv_activity.blocks_evicted += len(evicted)
        await self._publish_kv(
            [(KVEventKind.STORED, "dram", stored), (KVEventKind.REMOVED, "dram", evicted)]
        )

    async def _publish_kv(
        self, changes: list[tuple[KVEventKind, Literal["dram", "disk"], list[int]]]
    ) -> None:
        for kind, tier, hashes in changes:
            if hashes:
                event = KVEvent(
                    kind=kind,
                    instance_id=self.instance_id,
                    tier=tier,
                    block_hashes=hashes,
                    sent_at=time.time(),
                    block_nbytes=self.engine.kv.shape.block_nbytes,
                )
                await self.nc.publish(subjects.KV_EVENTS, event.encode())

    async def publish_cleared(self) -> None:
        event = KVEvent(kind=KVEventKind.CLEARED, instance_id=self.instance_id, sent_at=time.time())
        await self.nc.publish(subjects.KV_EVENTS, event.encode())
