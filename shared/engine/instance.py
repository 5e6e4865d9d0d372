"""What prefill and decode instances share: settings, the engine thread, the bus side.

Torch runs on one dedicated thread per instance, so the asyncio loop keeps answering
heartbeats, cancels and transfers while a forward pass is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from nats.aio.client import Client as NATS
from pydantic import Field

from shared import subjects
from shared.engine.output import OutputTracker
from shared.engine.runner import LoadedModel, ModelRunner
from shared.messages import (CancelRequest, ErrorBody, FinishReason, GenerateRequest,
                             InstanceInfo, KVEvent, KVEventKind, Role, TokenEvent, Usage)
from shared.settings import DEFAULT_MODEL_NAME, BaseSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerSettings(BaseSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")
    model: str = Field(DEFAULT_MODEL_NAME, description="model folder, or a name in HALFMOON_HOME/models")
    served_model_name: str = Field("", description="model name clients use (empty: folder name)")
    dtype: str = Field("bfloat16", description="weights and KV dtype: float32 | bfloat16")
    device: str = Field("cpu", description="torch device: cpu | cuda")
    threads: int = Field(0, ge=0, description="torch threads for this instance (0: torch default)")
    block_size: int = Field(16, gt=0, description="KV block size in tokens (hashing and events)")
    kv_host: str = Field("127.0.0.1", description="address the KV data plane binds")
    kv_advertise_host: str = Field("", description="address peers use to reach the data plane")
    kv_port: int = Field(0, ge=0, description="KV data plane port (0: any free port)")
    transfer_timeout_s: float = Field(30.0, gt=0, description="KV transfer timeout")


class CancelSet:
    """Request ids cancelled recently; old entries age out so the set stays small."""

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


class EngineInstance:
    role: Role

    def __init__(self, settings: WorkerSettings, nc: NATS, lm: LoadedModel) -> None:
        self.settings = settings
        self.nc = nc
        self.lm = lm
        self.runner = ModelRunner(lm)
        self.instance_id = settings.instance_id
        self.started_at = time.time()
        self.cancelled = CancelSet()
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.queue_depth = 0
        self.running = 0
        self.kv_tokens_used = 0
        self.kv_port = 0

    async def run_engine(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._engine, fn, *args)

    def close_engine(self) -> None:
        self._engine.shutdown(wait=True, cancel_futures=True)

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            instance_id=self.instance_id, role=self.role, pid=os.getpid(),
            started_at=self.started_at, kv_host=self.settings.kv_advertise_host or
            self.settings.kv_host, kv_port=self.kv_port, queue_depth=self.queue_depth,
            running=self.running, kv_tokens_used=self.kv_tokens_used, model=self.lm.name)

    async def on_cancel(self, msg: Any) -> None:
        req = CancelRequest.model_validate_json(msg.data)
        self.cancelled.add(req.request_id)

    def tracker(self, req: GenerateRequest) -> OutputTracker:
        return OutputTracker(params=req.sampling, decode=self.runner.decode_text,
                             eos_token_ids=self.lm.eos_token_ids,
                             prompt_len=len(req.prompt_token_ids),
                             max_model_len=self.lm.max_model_len)

    async def publish_tokens(self, req: GenerateRequest, index: int, token_ids: list[int],
                             text: str, finish: FinishReason | None,
                             tracker: OutputTracker) -> None:
        usage = None
        if finish is not None:
            usage = Usage(prompt_tokens=len(req.prompt_token_ids),
                          completion_tokens=tracker.completion_tokens)
        event = TokenEvent(request_id=req.request_id, index=index, token_ids=token_ids, text=text,
                           finish_reason=finish, usage=usage, instance_id=self.instance_id,
                           sent_at=time.time())
        await self.nc.publish(subjects.tokens(req.request_id), event.encode())

    async def publish_error(self, req: GenerateRequest, index: int, code: str, message: str) -> None:
        log.error("request %s failed: %s", req.request_id, message)
        event = TokenEvent(request_id=req.request_id, index=index,
                           finish_reason=FinishReason.ERROR, instance_id=self.instance_id,
                           error=ErrorBody(code=code, message=message), sent_at=time.time())
        await self.nc.publish(subjects.tokens(req.request_id), event.encode())

    async def publish_kv(self, kind: KVEventKind, hashes: list[int], block_nbytes: int) -> None:
        if not hashes and kind != KVEventKind.CLEARED:
            return
        event = KVEvent(kind=kind, instance_id=self.instance_id, block_hashes=hashes,
                        block_nbytes=block_nbytes, sent_at=time.time())
        await self.nc.publish(subjects.KV_EVENTS, event.encode())

    def block_nbytes(self) -> int:
        cfg = self.lm.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
        return per_token * self.settings.block_size * self.lm.dtype.itemsize
