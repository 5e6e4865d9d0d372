"""What prefill and decode instances share: settings, the engine thread, the bus side.

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
from pydantic import Field, model_validator

import torch

from shared import subjects, tls
from shared.engine import cpu
from shared.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from shared.engine.runner import LoadedModel
from shared.messages import (CancelRequest, ErrorBody, FinishReason, GenerateRequest,
                             InstanceInfo, KVActivity, KVEvent, KVEventKind, Role, TokenEvent,
                             Usage)
from shared.settings import DEFAULT_MODEL_NAME, BaseSettings, halfmoon_home
from shared.transfer import KVReceiver, KVSender

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerSettings(BaseSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")
    model: str = Field(DEFAULT_MODEL_NAME, description="model folder, or a name in HALFMOON_HOME/models")
    served_model_name: str = Field("", description="model name clients use (empty: folder name)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights and KV dtype; auto: bfloat16 where the CPU computes it "
        "natively (AVX-512 BF16, AMX, AVX-NE-CONVERT), float32 otherwise")
    quantization: Literal["none", "int8"] = Field(
        "none", description="int8: int8 weights per channel and activations per token (a "
        "quarter of fp32's bytes per decode step)")
    device: str = Field("cpu", description="torch device: cpu | cuda")
    threads: int = Field(0, ge=0, description="torch threads for this instance (0: torch default)")
    nice: int = Field(0, ge=0, le=19, description="CPU niceness: on a shared box a niced engine "
                      "lets the control plane (gateway, conductor) answer at once")
    block_size: int = Field(16, gt=0, le=64, description="KV block size in tokens")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV pool (DRAM tier) size in GiB")
    disk_tier_gb: float = Field(0.0, ge=0, description="KV disk tier size in GiB (0: off)")
    disk_tier_dir: str = Field("", description="disk tier folder (empty: HALFMOON_HOME/kvdisk/<id>)")
    max_num_seqs: int = Field(64, gt=0, description="sequences in the running batch at most")
    chunk_tokens: int = Field(512, gt=0, description="prefill chunk: tokens computed per step at most")
    kv_host: str = Field("127.0.0.1", description="address the KV data plane binds")
    kv_advertise_host: str = Field("", description="address peers use to reach the data plane")
    kv_port: int = Field(0, ge=0, description="KV data plane port (0: any free port)")
    transfer_timeout_s: float = Field(30.0, gt=0, description="KV transfer timeout")
    eviction: Literal["lru", "watermark"] = Field(
        "lru", description="lru: evict on demand; watermark: Mooncake Store's proactive eviction")
    high_watermark: float = Field(0.90, gt=0, le=1, description="watermark eviction starts above this")
    evict_ratio: float = Field(0.05, gt=0, lt=1, description="watermark eviction frees this share")
    hot_hits: int = Field(3, ge=0, description="soft-pin blocks hit this often (0: no pins)")
    pin_ttl_s: float = Field(60.0, gt=0, description="how long a hot block stays pinned")
    kv_transport: Literal["auto", "tcp"] = Field(
        "auto", description="auto: shared memory when both ends are on one host, else TCP")
    # Data-plane TLS is mutual or off (shared/tls.py says why); docs/deploy.md, "Security".
    kv_tls_cert: str = Field("", description="PEM certificate this instance presents on the "
                             "KV data plane, as sender and receiver (with kv_tls_key and "
                             "kv_tls_ca: mutual TLS; empty: plain TCP)")
    kv_tls_key: str = Field("", description="private key of kv_tls_cert")
    kv_tls_ca: str = Field("", description="CA bundle every peer's data-plane certificate "
                           "must chain to")
    kv_tls_hostname: str = Field("", description="name peers' data-plane certificates are "
                                 "checked against (empty: the peer's advertised host)")

    @model_validator(mode="after")
    def _kv_tls(self) -> "WorkerSettings":
        tls.kv_contexts(self.kv_tls_cert, self.kv_tls_key, self.kv_tls_ca)  # loads, or says why
        return self

    def engine_config(self) -> EngineConfig:
        disk_dir = self.disk_tier_dir or str(halfmoon_home() / "kvdisk" / self.instance_id)
        return EngineConfig(block_size=self.block_size, kv_cache_bytes=int(self.kv_cache_gb * 2**30),
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.chunk_tokens,
                            disk_tier_bytes=int(self.disk_tier_gb * 2**30), disk_tier_dir=disk_dir,
                            eviction=self.eviction, high_watermark=self.high_watermark,
                            evict_ratio=self.evict_ratio, hot_hits=self.hot_hits,
                            pin_ttl_s=self.pin_ttl_s, quantization=self.quantization)


def make_sender(settings: WorkerSettings) -> KVSender:
    from shared.transfer.shm import ShmKVSender
    from shared.transfer.tcp import TcpKVSender

    cls = ShmKVSender if settings.kv_transport == "auto" else TcpKVSender
    server_tls, _ = tls.kv_contexts(settings.kv_tls_cert, settings.kv_tls_key, settings.kv_tls_ca)
    return cls(settings.kv_host, settings.kv_port, settings.kv_advertise_host, tls=server_tls)


def make_receiver(settings: WorkerSettings) -> KVReceiver:
    from shared.transfer.shm import ShmKVReceiver
    from shared.transfer.tcp import TcpKVReceiver

    _, client_tls = tls.kv_contexts(settings.kv_tls_cert, settings.kv_tls_key, settings.kv_tls_ca)
    cls = ShmKVReceiver if settings.kv_transport == "auto" else TcpKVReceiver
    return cls(tls=client_tls, tls_hostname=settings.kv_tls_hostname)


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
    cached_tokens: int = 0


class EngineInstance:
    role: Role

    def __init__(self, settings: WorkerSettings, nc: NATS, lm: LoadedModel) -> None:
        self.settings = settings
        self.nc = nc
        self.lm = lm
        self.instance_id = settings.instance_id
        self.started_at = time.time()
        self.cancelled = CancelSet()
        # Ended here (finished, failed or handed on): a job for one again is a duplicate.
        self.finished = CancelSet()
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine = LLMEngine(lm, settings.engine_config())
        self.streams: dict[str, Stream] = {}
        self.kv_port = 0
        self._wake = asyncio.Event()
        self._stats = self.engine.stats()
        self.kv_activity = KVActivity()  # cumulative, sent with every heartbeat
        # What the conductor's cost-model prior must match (see calibration.py).
        self._engine_key = cpu.engine_key(lm.name, str(lm.dtype).removeprefix("torch."),
                                          settings.quantization, torch.get_num_threads())

    async def run_engine(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    def close_engine(self) -> None:
        self._engine_thread.shutdown(wait=True, cancel_futures=True)

    def wake(self) -> None:
        self._wake.set()

    def info(self) -> InstanceInfo:
        s = self._stats
        used = int(s["kv_blocks_total"] - s["kv_blocks_free"])
        disk_used, disk_free = self.disk_blocks()
        return InstanceInfo(
            instance_id=self.instance_id, role=self.role, pid=os.getpid(),
            started_at=self.started_at, kv_host=self.settings.kv_advertise_host or
            self.settings.kv_host, kv_port=self.kv_port, queue_depth=int(s["waiting"]),
            running=int(s["running"]), kv_tokens_used=used * self.settings.block_size, model=self.lm.name,
            queue_prompts=s["queue_prompts"][:256], mean_context=s["mean_context"],
            kv_blocks_total=int(s["kv_blocks_total"]), kv_blocks_free=int(s["kv_blocks_free"]),
            kv_blocks_cached=int(s["kv_blocks_cached"]), disk_blocks_used=disk_used,
            disk_blocks_free=disk_free, kv_activity=self.kv_activity,
            kv_blocks_leased=self.leased_blocks(), engine_key=self._engine_key)

    def heartbeat(self) -> InstanceInfo:
        """info(), plus the cost samples of work done since the previous heartbeat."""
        samples = []
        while self.engine.cost_samples and len(samples) < 64:
            samples.append(self.engine.cost_samples.popleft())
        return self.info().model_copy(update={"cost_samples": samples})

    def leased_blocks(self) -> int:
        """Blocks' worth of KV held outside the pool for requests (subclasses that hold any)."""
        return 0

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
        """Step while there is work; sleep on the wake event otherwise."""
        while not stop.is_set():
            await self.after_step()
            if not self.engine.has_work():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.25)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                outputs = await self.run_engine(self.engine.step)
            except Exception:  # noqa: BLE001 - fail what ran, keep the instance alive
                log.exception("engine step failed")
                await self.fail_all("engine step failed")
                continue
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
        return (request_id in self.cancelled or request_id in self.finished
                or request_id in self.streams)

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
        def run() -> dict[str, Any]:
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
            usage = Usage(prompt_tokens=out.num_prompt_tokens,
                          completion_tokens=out.num_output_tokens,
                          cached_tokens=max(stream.cached_tokens, out.num_cached_tokens))
            self.streams.pop(out.request_id)
            self.finished.add(out.request_id)
        event = TokenEvent(request_id=out.request_id, index=stream.next_index,
                           token_ids=out.new_token_ids, text=out.text,
                           finish_reason=out.finish_reason, usage=usage,
                           instance_id=self.instance_id, sent_at=time.time())
        stream.next_index += 1
        await self.nc.publish(subjects.tokens(out.request_id), event.encode())

    async def finish_with_error(self, request_id: str, code: str, message: str,
                                stream: Stream | None = None) -> None:
        stream = stream or self.streams.pop(request_id, None)
        if stream is None:
            return
        self.streams.pop(request_id, None)
        self.finished.add(request_id)
        log.error("request %s failed: %s", request_id, message)
        event = TokenEvent(request_id=request_id, index=stream.next_index,
                           finish_reason=FinishReason.ERROR, instance_id=self.instance_id,
                           error=ErrorBody(code=code, message=message), sent_at=time.time())
        await self.nc.publish(subjects.tokens(request_id), event.encode())

    async def publish_kv_events(self) -> None:
        step = self.engine.last_step
        a = self.kv_activity
        a.blocks_stored += len(step.kv_stored)
        a.blocks_evicted += len(step.kv_evicted)
        a.disk_stored += len(step.disk_stored)
        a.disk_removed += len(step.disk_removed)
        for kind, tier, hashes in ((KVEventKind.STORED, "dram", step.kv_stored),
                                   (KVEventKind.REMOVED, "dram", step.kv_evicted),
                                   (KVEventKind.STORED, "disk", step.disk_stored),
                                   (KVEventKind.REMOVED, "disk", step.disk_removed)):
            if hashes:
                event = KVEvent(kind=kind, instance_id=self.instance_id, tier=tier,
                                block_hashes=hashes, sent_at=time.time(),
                                block_nbytes=self.engine.kv.shape.block_nbytes)
                await self.nc.publish(subjects.KV_EVENTS, event.encode())

    async def publish_cleared(self) -> None:
        event = KVEvent(kind=KVEventKind.CLEARED, instance_id=self.instance_id, sent_at=time.time())
        await self.nc.publish(subjects.KV_EVENTS, event.encode())
