"""The gateway following a token stream across faults, over a real nats-server.

Workers are plain NATS subscribers here that publish token events the way prefill and
decode do; heartbeats go straight into the gateway's Liveness. The unit under test is the
Follower: it must notice a dead instance, a lost event and a worker error, place the
request again (no token yet: through `place`; else on a live decode instance, with the
tokens and text so far) and yield one stream with no duplicate and no gap.

No step waits on the clock: every instance is heard before the request is placed, and an
instance dies only once the follower has got as far as the test needs (events consumed,
or the instance checked on).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats
import pytest

from services.gateway.args import GatewaySettings
from services.gateway.streams import Follower, Liveness, StreamLost, TokenStream
from shared import bus, subjects
from shared.messages import (
    Ack,
    DecodeJob,
    ErrorBody,
    FinishReason,
    GenerateRequest,
    InstanceInfo,
    Placement,
    Role,
    TokenEvent,
)
from tests.factories import request
from tests.waiting import until

SETTINGS = GatewaySettings(
    instance_expiry_s=1.0,
    gap_timeout_s=0.5,
    max_replacements=2,
    replace_wait_s=5.0,
    first_token_timeout_s=10.0,
    token_timeout_s=10.0,
)


async def emit(
    nc, rid: str, index: int, token: int, iid: str, last: bool = False, error: str = ""
) -> None:
    event = TokenEvent(
        request_id=rid,
        index=index,
        token_ids=[] if error else [token],
        text="" if error else chr(ord("a") + token % 26),
        instance_id=iid,
        finish_reason=(FinishReason.ERROR if error else FinishReason.LENGTH if last else None),
        error=ErrorBody(code=error, message="gone") if error else None,
    )
    await nc.publish(subjects.tokens(rid), event.encode())


class Beats:
    """Heartbeats into a Liveness: the gateway's own always, workers while `alive`. The
    first round is in the constructor: every worker is known before anything is placed."""

    def __init__(self, live: Liveness, workers: dict[str, Role]) -> None:
        self.live, self.workers = live, workers
        self.alive = set(workers)
        self._beat()
        self.task = asyncio.create_task(self._run())

    def _beat(self) -> None:
        now = time.monotonic()
        self.live.beat(InstanceInfo(instance_id="gw", role=Role.GATEWAY), now)
        for iid in self.alive:
            self.live.beat(
                InstanceInfo(instance_id=iid, role=self.workers[iid], started_at=1.0), now
            )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self._beat()

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def fake_decode(nc, iid: str, jobs: list[DecodeJob], tokens: int = 6):
    """Takes a re-placed job and streams the rest of it, from the job's index on."""

    async def on_submit(msg):
        job = DecodeJob.model_validate_json(msg.data)
        jobs.append(job)
        await bus.respond(msg, Ack())
        done = len(job.output_token_ids)
        for i, tok in enumerate(range(done, tokens)):
            await emit(
                nc, job.request.request_id, job.events_sent + i, tok, iid, last=tok == tokens - 1
            )

    return await nc.subscribe(subjects.decode_submit(iid), cb=on_submit)


@pytest.fixture
async def nc(nats_url):
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


async def follow(nc, rid: str, live: Liveness, place=None, settings=SETTINGS):
    async def no_place(gen):
        raise AssertionError("no conductor placement expected")

    stream = await TokenStream(nc, rid, settings.gap_timeout_s).open()
    f = Follower(nc, settings, live, stream, request(rid, max_tokens=6), place or no_place)
    f.placed(Placement(request_id=rid, prefill_id="p0", decode_id="d0"))
    return f, stream


async def collect(f: Follower, into: list[TokenEvent] | None = None) -> list[TokenEvent]:
    """The follower's events; `into` shows them as they come."""
    out = [] if into is None else into
    async for e in f.events():
        out.append(e)
    return out


async def test_decode_death_mid_stream_continues_on_another_decode(nc):
    live = Liveness(SETTINGS.instance_expiry_s)
    beats = Beats(live, {"p0": Role.PREFILL, "d0": Role.DECODE, "d1": Role.DECODE})
    jobs: list[DecodeJob] = []
    sub = await fake_decode(nc, "d1", jobs)
    f, stream = await follow(nc, "r1", live)
    streamed: list[TokenEvent] = []
    task = asyncio.create_task(collect(f, streamed))
    await emit(nc, "r1", 0, 0, "p0")
    await emit(nc, "r1", 1, 1, "d0")
    await emit(nc, "r1", 2, 2, "d0")
    await until(lambda: len(streamed) == 3, what="the first three events")
    beats.alive.discard("d0")  # decode d0 dies: its heartbeats stop
    events = await asyncio.wait_for(task, 30)
    await emit(nc, "r1", 3, 99, "d0")  # a straggler of the old attempt changes nothing
    assert [e.index for e in events] == list(range(6))
    assert [t for e in events for t in e.token_ids] == list(range(6))
    assert events[-1].finish_reason == FinishReason.LENGTH
    (job,) = jobs
    assert job.kv is None and job.request.request_id == "r1-r1"
    assert job.output_token_ids == [0, 1, 2] and job.emitted_text == "abc"
    assert job.events_sent == 3 and job.request.prompt_token_ids == [1, 2, 3]
    assert f.attempt is not None and f.attempt.decode_id == "d1" and f.replacements == 1
    await sub.unsubscribe()
    await stream.close()
    await beats.stop()


async def test_a_lost_event_is_noticed_and_the_rest_recomputed(nc):
    live = Liveness(SETTINGS.instance_expiry_s)
    beats = Beats(live, {"p0": Role.PREFILL, "d0": Role.DECODE, "d1": Role.DECODE})
    jobs: list[DecodeJob] = []
    sub = await fake_decode(nc, "d1", jobs)
    f, stream = await follow(nc, "r2", live)
    task = asyncio.create_task(collect(f))
    for i in (0, 1, 3, 4):  # event 2 was published while NATS was away
        await emit(nc, "r2", i, i, "d0")
    events = await asyncio.wait_for(task, 30)
    assert [e.index for e in events] == list(range(6))
    assert [t for e in events for t in e.token_ids] == list(range(6))
    assert jobs[0].output_token_ids == [0, 1] and jobs[0].events_sent == 2
    assert jobs[0].request.request_id == "r2-r1"
    await sub.unsubscribe()
    await stream.close()
    await beats.stop()


async def test_prefill_death_before_the_first_token_places_it_again(nc):
    live = Liveness(SETTINGS.instance_expiry_s)
    beats = Beats(live, {"p0": Role.PREFILL, "p1": Role.PREFILL, "d0": Role.DECODE})
    placed: list[GenerateRequest] = []

    async def place(gen: GenerateRequest) -> Placement:
        placed.append(gen)

        async def serve() -> None:  # the new prefill + decode stream it from index 0
            for i in range(6):
                await emit(nc, gen.request_id, i, i, "p1" if i == 0 else "d0", last=i == 5)

        serving.append(asyncio.create_task(serve()))  # runs once the placement is back
        return Placement(request_id=gen.request_id, prefill_id="p1", decode_id="d0")

    serving: list[asyncio.Task] = []
    f, stream = await follow(nc, "r3", live, place)
    waiting_on_p0 = asyncio.Event()
    check = f.check

    def watched(next_index: int) -> str | None:
        why = check(next_index)
        if why is None and f.attempt is not None and f.attempt.prefill_id == "p0":
            waiting_on_p0.set()
        return why

    f.check = watched  # type: ignore[method-assign]
    task = asyncio.create_task(collect(f))
    await asyncio.wait_for(waiting_on_p0.wait(), 30)  # it waits for p0's first token...
    beats.alive.discard("p0")  # ...queued on p0, which dies before computing anything
    events = await asyncio.wait_for(task, 30)
    assert [e.index for e in events] == list(range(6))
    assert [g.request_id for g in placed] == ["r3-r1"]
    assert f.attempt is not None and f.attempt.prefill_id == "p1"
    await stream.close()
    await beats.stop()


async def test_a_worker_that_gives_up_is_replaced(nc):
    live = Liveness(SETTINGS.instance_expiry_s)
    beats = Beats(live, {"p0": Role.PREFILL, "d0": Role.DECODE, "d1": Role.DECODE})
    jobs: list[DecodeJob] = []
    sub = await fake_decode(nc, "d1", jobs)
    f, stream = await follow(nc, "r4", live)
    task = asyncio.create_task(collect(f))
    await emit(nc, "r4", 0, 0, "p0")
    await emit(nc, "r4", 1, 0, "d0", error="unavailable")  # d0 shutting down
    events = await asyncio.wait_for(task, 30)
    assert all(e.error is None for e in events)
    assert [t for e in events for t in e.token_ids] == list(range(6))
    assert jobs[0].events_sent == 2  # the error event used index 1; the client never saw it
    assert [e.index for e in events] == [0, 2, 3, 4, 5, 6]
    await sub.unsubscribe()
    await stream.close()
    await beats.stop()


async def test_past_the_limit_an_error_or_a_death_ends_the_request_clearly(nc):
    live = Liveness(SETTINGS.instance_expiry_s)
    beats = Beats(live, {"p0": Role.PREFILL, "d0": Role.DECODE})
    settings = SETTINGS.model_copy(update={"max_replacements": 0})
    f, stream = await follow(nc, "r5", live, settings=settings)
    task = asyncio.create_task(collect(f))
    await emit(nc, "r5", 0, 0, "p0")
    await emit(nc, "r5", 1, 0, "d0", error="unavailable")
    events = await asyncio.wait_for(task, 30)  # no retries left: the error goes through
    assert events[-1].error is not None and events[-1].error.code == "unavailable"
    await stream.close()

    f, stream = await follow(nc, "r6", live, settings=settings)
    task = asyncio.create_task(collect(f))
    await emit(nc, "r6", 0, 0, "p0")
    beats.alive.discard("d0")
    with pytest.raises(StreamLost, match="d0 lost the request"):
        await asyncio.wait_for(task, 30)
    await stream.close()
    await beats.stop()
