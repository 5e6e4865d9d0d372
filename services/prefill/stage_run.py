"""A pipelined-prefill stage's state on a prefill instance (stages.py runs it): what it
needs of its instance, one request's run, and what a pipelined prompt cannot have yet."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypeVar

from nats.aio.client import Client as NATS

from services.prefill.args import PrefillSettings
from services.prefill.offers import KVOffers
from services.worker.instance import CancelSet, Stream
from shared.engine.engine_types import RequestOutput
from shared.engine.hidden import HiddenChunk
from shared.engine.runner import LoadedModel
from shared.engine.stage import StageRunner
from shared.groups import group_holder
from shared.messages import KVHandle, StageJob
from shared.transfer import KVReceiver, KVSender

T = TypeVar("T")


class Host(Protocol):
    """What a stage needs of the prefill instance it runs on (handlers.PrefillInstance)."""

    settings: PrefillSettings
    lm: LoadedModel
    instance_id: str
    nc: NATS
    sender: KVSender
    receiver: KVReceiver
    offers: KVOffers
    streams: dict[str, Stream]
    finished: CancelSet
    intake_open: bool

    async def run_engine(self, fn: Callable[..., T], *args: Any) -> T: ...
    async def publish_output(self, out: RequestOutput) -> None: ...
    async def finish_with_error(
        self, request_id: str, code: str, message: str, stream: Stream | None = None
    ) -> None: ...
    def known(self, request_id: str) -> bool: ...


@dataclass
class StageRun:
    """One request's stage on this instance."""

    job: StageJob
    runner: StageRunner | None  # None until a layer range's first prompt has built it
    hops: asyncio.Queue[tuple[HiddenChunk, list[KVHandle]]] = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    slice: KVHandle | None = None  # this stage's KV slice, offered once its layers are done

    @property
    def built(self) -> StageRunner:
        assert self.runner is not None, "a stage's runner is built before its chunks run"
        return self.runner

    @property
    def holder(self) -> str:
        """The group's id in the KV index, which its stages publish their blocks under."""
        return group_holder(
            [(s.instance_id, (s.first_layer, s.end_layer)) for s in self.job.stages]
        )


def unsupported(job: StageJob) -> str | None:
    """What a pipelined prompt cannot have yet, by name; None if nothing."""
    s, req = job.request.sampling, job.request
    named = [
        name
        for name, asked in (
            ("logprobs", s.logprobs is not None),
            ("prompt_logprobs", req.prompt_logprobs is not None),
            ("structured output", s.constraint is not None),
        )
        if asked
    ]
    return ", ".join(named) or None
