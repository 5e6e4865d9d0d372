"""One client request as one or more sub-requests, and the merged stream of their events.

A request with `n` > 1 (or a batch of completion prompts) is fanned out here into one
GenerateRequest per choice, ids `{id}-{k}`, each placed by the conductor as usual (its
own record, decision, token stream and fault handling), seeds `seed + i` when a seed is
given. A prompt's first choice is placed first and the others follow it to its prefill
instance (GenerateRequest.follow_prefill), which computes the prompt once: one prefill,
n decodes, whose handoffs share the prompt's blocks on a decode instance. Their events
are merged into one stream of (choice, event) for the response writers.

Records: one per sub-request (n = 1: the request's own id, as before), so each choice's
placement, instances and timings stay inspectable at /admin/requests/{id}-{k}.
Metrics count the client's request once: one TTFT (its first token, any choice), one
outcome and one e2e; ITL per choice; prompt tokens once per prompt, every generated token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncGenerator, Awaitable, Callable, Protocol

from services.gateway.context import GatewayContext
from services.gateway.life import RequestLife
from services.gateway.metrics import GatewayMetrics
from services.gateway.streams import Follower, TokenStream
from shared import errors
from shared.db.schema import RequestStatus
from shared.messages import FinishReason, GenerateRequest, Placement, TokenEvent, Usage

log = logging.getLogger(__name__)


class Placer(Protocol):
    """Places a (sub-)request on instances: ConductorPlacer (placement.py) asks the
    conductor. A refusal is recorded in `life` and raised."""

    async def place(
        self,
        gen: GenerateRequest,
        life: RequestLife,
        retarget: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> Placement: ...

    def placed_again(self, request_id: str, prefill_id: str, decode_id: str) -> None:
        """A fault moved the request to other instances (streams.Follower)."""


class FirstTokenOnce:
    """The choices of one request share its TTFT: only the first token of any choice is
    one; each choice's later tokens are its inter-token gaps."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.seen = False

    def token_event(self, arrival: float, previous: float | None, now: float) -> None:
        if previous is not None:
            self.metrics.itl.observe(now - previous)
        elif not self.seen:
            self.seen = True
            self.metrics.ttft.observe(now - arrival)


@dataclass
class Sub:
    index: int  # the choice index in the response
    prompt_index: int
    gen: GenerateRequest
    life: RequestLife
    stream: TokenStream | None = None
    follow: Follower | None = None
    prefill_id: str = ""  # where it was placed (its prompt's later choices follow it there)


class Fanout:
    def __init__(self, ctx: GatewayContext, placer: Placer, subs: list[Sub], stream: bool) -> None:
        self.ctx = ctx
        self.placer = placer
        self.subs = subs
        self.stream = stream
        if len(subs) > 1:
            shared = FirstTokenOnce(ctx.metrics)
            for s in subs:
                s.life.metrics = shared
        else:
            subs[0].life.metrics = ctx.metrics

    @property
    def arrival(self) -> float:
        return self.subs[0].life.arrival

    async def start(self) -> None:
        """Records, token streams (subscribed before dispatch), then the placements: the
        first choice of each prompt at once, then the rest. One refused (429, 503...)
        refuses the request: the others are cancelled."""
        for s in self.subs:
            self.ctx.records.request_accepted(
                id=s.gen.request_id,
                model=s.gen.model,
                tenant=s.gen.tenant,
                status=RequestStatus.QUEUED.value,
                arrival_time=s.gen.arrival_time,
                prompt_tokens=len(s.gen.prompt_token_ids),
                max_tokens=s.gen.sampling.max_tokens,
                stream=self.stream,
            )
            s.stream = await TokenStream(
                self.ctx.nc, s.gen.request_id, self.ctx.settings.gap_timeout_s
            ).open()
            s.follow = self._follower(s, s.stream)
        # The first choice of each prompt is placed first; the others then follow it to its
        # prefill instance, which computes the prompt once for all of them (policy.follow).
        first: dict[int, Sub] = {}
        for s in self.subs:
            first.setdefault(s.prompt_index, s)
        followers = [s for s in self.subs if first[s.prompt_index] is not s]
        await self._place_all(list(first.values()))
        for s in followers:
            s.gen.follow_prefill = first[s.prompt_index].prefill_id
        await self._place_all(followers)

    def _follower(self, s: Sub, stream: TokenStream) -> Follower:
        """Follows the choice's events across faults, placing it again through the placer."""
        life, request_id = s.life, s.gen.request_id

        async def place_again(again: GenerateRequest) -> Placement:
            return await self.placer.place(again, life)

        def placed_again(prefill_id: str, decode_id: str) -> None:
            self.placer.placed_again(request_id, prefill_id, decode_id)

        ctx = self.ctx
        return Follower(
            ctx.nc, ctx.settings, ctx.liveness, stream, s.gen, place_again, placed_again
        )

    async def _place_all(self, subs: list[Sub]) -> None:
        results = await asyncio.gather(*(self._place(s) for s in subs), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                for s in self.subs:
                    if s.life.error is None:
                        s.life.status = RequestStatus.CANCELLED
                        s.life.error = "another choice of the request could not be placed"
                raise r

    async def _place(self, s: Sub) -> None:
        assert s.stream is not None and s.follow is not None
        placement = await self.placer.place(s.gen, s.life, s.stream.retarget)
        s.prefill_id = placement.prefill_id
        s.follow.placed(placement)
        self.ctx.records.request_update(
            s.gen.request_id,
            status=RequestStatus.RUNNING.value,
            prefill_instance=placement.prefill_id,
            # colocated: the prefill instance decodes too
            decode_instance=placement.decode_id or placement.prefill_id,
        )

    async def events(self) -> AsyncGenerator[tuple[Sub, TokenEvent], None]:
        """Every choice's events as they come, each choice's in order, until all end. A
        worker's error arrives as an event (with `error`); a timeout or a request that
        could not be placed again raises."""
        # A choice's event, the error that ended it, or None: it is over.
        queue: asyncio.Queue[tuple[Sub, TokenEvent | errors.HalfmoonError | None]]
        queue = asyncio.Queue()

        async def pump(s: Sub) -> None:
            assert s.follow is not None
            try:
                async with contextlib.aclosing(s.follow.events()) as events:
                    async for event in events:
                        await queue.put((s, event))
            except errors.HalfmoonError as exc:
                await queue.put((s, exc))
            await queue.put((s, None))

        tasks = [asyncio.create_task(pump(s)) for s in self.subs]
        remaining = len(tasks)
        try:
            while remaining:
                s, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, errors.HalfmoonError):
                    s.life.error = s.life.error or f"{item.code}: {item.message}"
                    raise item
                if item.error is not None:
                    s.life.error = f"{item.error.code}: {item.error.message}"
                else:
                    s.life.on_event(item)
                yield s, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def disconnected(self, why: str) -> None:
        for s in self.subs:
            if s.life.status != RequestStatus.COMPLETED:
                s.life.status, s.life.error = RequestStatus.CANCELLED, f"client disconnected: {why}"
                s.life.finish_reason = FinishReason.CANCELLED.value

    async def close(self) -> None:
        """Whatever is left of each choice, anywhere: one cancel for every way it can end;
        then each record's terminal row, and the request's metrics."""
        for s in self.subs:
            if (
                s.follow is not None
                and s.follow.attempt is not None
                and s.life.status != RequestStatus.COMPLETED
            ):
                await s.follow.cancel(s.life.error or "request ended")
            if s.stream is not None:
                await s.stream.close()
            self.ctx.records.request_finished(
                s.gen.request_id, s.life.status.value, **s.life.terminal_values()
            )
        self._count()

    def _count(self) -> None:
        lives = [s.life for s in self.subs]
        if len(lives) == 1:
            self.ctx.metrics.finished(lives[0], len(self.subs[0].gen.prompt_token_ids))
            return
        status = next(
            (lf.status for lf in lives if lf.status != RequestStatus.COMPLETED),
            RequestStatus.COMPLETED,
        )
        self.ctx.metrics.finished_request(
            status,
            self.arrival,
            prompt_tokens(self.subs),
            sum(lf.num_tokens for lf in lives),
            cached_tokens(self.subs),
        )


def prompt_tokens(subs: list[Sub]) -> int:
    """Each distinct prompt once, as OpenAI counts n > 1."""
    seen: dict[int, int] = {}
    for s in subs:
        seen[s.prompt_index] = len(s.gen.prompt_token_ids)
    return sum(seen.values())


def cached_tokens(subs: list[Sub]) -> int:
    """Per prompt, the cache hits of the choice that hit least: the one that computed it."""
    least: dict[int, int] = {}
    for s in subs:
        got = s.life.usage.cached_tokens if s.life.usage else 0
        least[s.prompt_index] = min(least.get(s.prompt_index, got), got)
    return sum(least.values())


def usage_of(subs: list[Sub], counted: bool = True) -> Usage:
    """The response's usage: prompts once, every choice's completion tokens (none when
    `counted` is False: echo with max_tokens 0 generates nothing the client gets)."""
    done = (
        sum(s.life.usage.completion_tokens if s.life.usage else s.life.num_tokens for s in subs)
        if counted
        else 0
    )
    return Usage(
        prompt_tokens=prompt_tokens(subs), completion_tokens=done, cached_tokens=cached_tokens(subs)
    )
