"""Prefill and decode instances under faults, on a random-weight model with real NATS and
real TCP transfers: a failed KV transfer falls back to recomputing, a cancel frees the
engine's blocks and the KV held for a transfer at once (and the heartbeat says so without
waiting for a step), and a job delivered twice runs once."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import nats
import pytest

from services.decode.args import DecodeSettings
from services.decode.handlers import DecodeInstance
from services.prefill.args import PrefillSettings
from services.prefill.handlers import PrefillInstance
from shared import bus, subjects
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams as EngineParams
from shared.messages import (
    Ack,
    CancelRequest,
    DecodeJob,
    GenerateRequest,
    KVHandle,
    PrefillJob,
    SamplingParams,
    TokenEvent,
)
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender
from tests.factories import tiny_llama
from tests.waiting import until

PROMPT = list(range(1, 41))  # 40 tokens: 2 full blocks of 16 and a partial one
TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


def gen(rid: str, prompt: list[int] = PROMPT) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="tiny",
        prompt_token_ids=prompt,
        sampling=params(),
        arrival_time=time.time(),
    )


def reference(tiny, prompt: list[int] = PROMPT) -> list[int]:
    engine = LLMEngine(tiny, EngineConfig(kv_cache_bytes=4 << 20))
    engine.add_request("ref", prompt, EngineParams.of(params()))
    out: list[int] = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


class Events:
    """A request's token events, as the gateway would receive them."""

    def __init__(self) -> None:
        self.got: list[TokenEvent] = []
        self.finished = asyncio.Event()

    async def on_msg(self, msg) -> None:  # type: ignore[no-untyped-def]
        event = TokenEvent.model_validate_json(msg.data)
        self.got.append(event)
        if event.finish_reason is not None:
            self.finished.set()


@contextlib.asynccontextmanager
async def running(inst):  # type: ignore[no-untyped-def]
    stop = asyncio.Event()
    task = asyncio.create_task(inst.serve(stop))
    await inst.nc.subscribe(subjects.CANCEL, cb=inst.on_cancel)
    try:
        yield inst
    finally:
        stop.set()
        await task
        inst.close_engine()


@pytest.fixture
async def nc(nats_url):
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


def decode_instance(nc, tiny, iid: str) -> DecodeInstance:
    return DecodeInstance(
        DecodeSettings(instance_id=iid, kv_cache_gb=4 / 1024, transfer_timeout_s=2.0),
        nc,
        tiny,
        TcpKVReceiver(),
    )


async def listen(nc, request_id: str) -> Events:  # type: ignore[no-untyped-def]
    """The request's token events from here on."""
    events = Events()
    await nc.subscribe(subjects.tokens(request_id), cb=events.on_msg)
    return events


@contextlib.contextmanager
def dead_handoff(transfer_id: str) -> Iterator[KVHandle]:
    """A handoff whose prefill died: the port is held here, bound and never listening, so
    nobody can take it meanwhile and every connection to it is refused."""
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        yield KVHandle(
            transfer_id=transfer_id,
            host="127.0.0.1",
            port=dead.getsockname()[1],
            nbytes=64,
            num_tokens=len(PROMPT),
        )


async def test_a_failed_kv_transfer_is_recomputed_and_the_stream_goes_on(nc, tiny):
    ref = reference(tiny)
    events = await listen(nc, "r1")
    with dead_handoff("r1.x") as gone:
        async with running(decode_instance(nc, tiny, "decode-a")) as dec:
            job = DecodeJob(
                request=gen("r1"),
                prefill_id="prefill-gone",
                kv=gone,
                output_token_ids=ref[:1],
                events_sent=1,
            )
            await dec.admit(job)
            await asyncio.wait_for(events.finished.wait(), 30)
    assert [e.index for e in events.got] == list(range(1, TOKENS))
    assert [t for e in events.got for t in e.token_ids] == ref[1:]
    assert events.got[-1].usage is not None and events.got[-1].usage.completion_tokens == TOKENS


async def test_a_job_delivered_twice_runs_once(nc, tiny):
    ref = reference(tiny)
    events = Events()
    await nc.subscribe(subjects.tokens("r2"), cb=events.on_msg)
    async with running(decode_instance(nc, tiny, "decode-b")) as dec:
        job = DecodeJob(
            request=gen("r2"), prefill_id="", kv=None, output_token_ids=ref[:3], events_sent=3
        )
        await asyncio.gather(dec.admit(job), dec.admit(job))
        await asyncio.wait_for(events.finished.wait(), 30)
        await until(lambda: not dec.engine.has_work() and not dec.streams, what="idle")
        await dec.admit(job)  # done now: still never a second copy
        assert not dec.engine.has_work() and "r2" not in dec.streams  # (it would be by now)
        # Whatever it published came before this marker (one connection, in order).
        marker = TokenEvent(request_id="marker", index=10**6)
        await nc.publish(subjects.tokens("r2"), marker.encode())
        await until(lambda: events.got and events.got[-1].request_id == "marker")
        events.got.pop()
    assert [e.index for e in events.got] == list(range(3, TOKENS))
    assert [t for e in events.got for t in e.token_ids] == ref[3:]


async def test_cancel_frees_blocks_and_the_heartbeat_says_so_at_once(nc, tiny):
    async with running(decode_instance(nc, tiny, "decode-c")) as dec:
        long = GenerateRequest(
            request_id="r3",
            model="tiny",
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
            arrival_time=time.time(),
        )
        await dec.admit(
            DecodeJob(request=long, prefill_id="", kv=None, output_token_ids=[5], events_sent=1)
        )
        await until(lambda: dec.info().running == 1, what="the request running")
        busy = dec.info()
        assert busy.running == 1 and busy.kv_blocks_free < busy.kv_blocks_total
        await nc.publish(subjects.CANCEL, CancelRequest(request_id="r3").encode())
        await until(lambda: not dec.streams and dec.info().running == 0, what="the cancel")
        idle = dec.info()  # no step ran since: the cancel itself refreshed these
        assert idle.running == 0 and idle.kv_blocks_free == idle.kv_blocks_total
        assert not dec.engine.has_work() and "r3" not in dec.engine.requests


async def test_cancel_withdraws_a_handoff_nobody_fetched(nc, tiny):
    sender = TcpKVSender()
    await sender.start()
    taken: list[DecodeJob] = []

    async def lazy_decode(msg) -> None:  # type: ignore[no-untyped-def]
        taken.append(DecodeJob.model_validate_json(msg.data))
        await bus.respond(msg, Ack())  # takes the job, never fetches the KV

    await nc.subscribe(subjects.decode_submit("decode-lazy"), cb=lazy_decode)
    settings = PrefillSettings(
        instance_id="prefill-d", kv_cache_gb=4 / 1024, transfer_timeout_s=60.0
    )
    inst = PrefillInstance(settings, nc, tiny, sender, TcpKVReceiver())
    async with running(inst) as pre:
        await nc.subscribe(subjects.prefill_submit("prefill-d"), cb=pre.on_submit)
        job = PrefillJob(request=gen("r4"), decode_id="decode-lazy")
        await bus.request(nc, subjects.prefill_submit("prefill-d"), job, Ack, 5.0)
        await until(lambda: taken, what="the handoff")
        assert taken and taken[0].kv is not None
        tid = taken[0].kv.transfer_id  # the sender's capability, not the request id
        assert len(tid) == 32 and int(tid, 16) >= 0 and "r4" not in tid
        leased = pre.info().kv_blocks_leased
        assert leased == 3 and sender.pending == 1  # 40 tokens: 3 blocks offered
        await nc.publish(subjects.CANCEL, CancelRequest(request_id="r4").encode())
        await until(
            lambda: sender.pending == 0 and pre.info().kv_blocks_leased == 0,
            what="the offer withdrawn",
        )
        assert sender.pending == 0 and pre.info().kv_blocks_leased == 0  # not at its 60 s TTL
    await sender.close()


async def test_a_job_waiting_for_the_engine_thread_is_in_the_heartbeats_queue(nc, tiny):
    """Adding a job waits for the engine thread, up to a whole step; the heartbeat's stats
    date from before it. The job must still show as queued work, or the conductor (which
    forgets its own dispatches at each heartbeat) would admit the next requests as if the
    queue were empty. Here the engine thread is held, as a long prefill chunk holds it."""
    sender = TcpKVSender()
    await sender.start()
    settings = PrefillSettings(instance_id="prefill-q", kv_cache_gb=4 / 1024)
    inst = PrefillInstance(settings, nc, tiny, sender, TcpKVReceiver())
    events = Events()
    await nc.subscribe(subjects.tokens("r5"), cb=events.on_msg)
    gate = threading.Event()
    async with running(inst) as pre:
        await nc.subscribe(subjects.prefill_submit("prefill-q"), cb=pre.on_submit)
        held = asyncio.create_task(pre.run_engine(gate.wait, 30.0))  # the "long step"
        job = PrefillJob(request=gen("r5"), decode_id="")  # decoded here: no handoff
        await bus.request(nc, subjects.prefill_submit("prefill-q"), job, Ack, 5.0)
        beat = pre.heartbeat()
        assert not pre.engine.has_work()  # the engine has not seen it...
        assert beat.queue_depth == 1 and beat.queue_prompts == [len(PROMPT)]  # ...the beat has
        gate.set()
        await held
        await asyncio.wait_for(events.finished.wait(), 30)
        await until(lambda: not pre.info().queue_prompts, what="the queue empty")
        assert pre.info().queue_depth == 0 and not pre.intake
    await sender.close()


async def test_a_slow_decode_ack_does_not_hold_the_next_prompt(nc, tiny):
    """A handoff (offer the KV, wait for decode's ack) runs beside the prefill engine's
    next steps: with decode slow to ack the first request, the second is prefilled and its
    first token sent meanwhile. Were the handoff in the engine loop, the second would wait
    for the first's ack, or for its 5 s timeout, which fails the first."""
    sender = TcpKVSender()
    await sender.start()
    gate = asyncio.Event()
    taken: list[str] = []

    async def slow_decode(msg) -> None:  # type: ignore[no-untyped-def]
        await gate.wait()
        taken.append(DecodeJob.model_validate_json(msg.data).request.request_id)
        await bus.respond(msg, Ack())

    await nc.subscribe(subjects.decode_submit("decode-slow"), cb=slow_decode)
    settings = PrefillSettings(instance_id="prefill-s", kv_cache_gb=4 / 1024)
    events = {rid: Events() for rid in ("s1", "s2")}
    for rid, ev in events.items():
        await nc.subscribe(subjects.tokens(rid), cb=ev.on_msg)
    inst = PrefillInstance(settings, nc, tiny, sender, TcpKVReceiver())
    async with running(inst) as pre:
        await nc.subscribe(subjects.prefill_submit("prefill-s"), cb=pre.on_submit)
        first = PrefillJob(request=gen("s1"), decode_id="decode-slow")
        await bus.request(nc, subjects.prefill_submit("prefill-s"), first, Ack, 5.0)
        await until(lambda: events["s1"].got, what="the first request's first token")
        second = PrefillJob(request=gen("s2", [7, *PROMPT[1:]]), decode_id="decode-slow")
        await bus.request(nc, subjects.prefill_submit("prefill-s"), second, Ack, 5.0)
        await until(lambda: events["s2"].got, what="the second request's first token")
        dispatches = [c for c in pre.engine.cost_samples if c.kind == "dispatch"]
        assert len(dispatches) == 2 and all(0 <= c.seconds < 30 for c in dispatches)  # way in
        assert not taken  # decode has acked nothing yet...
        assert all(e.error is None for e in events["s1"].got)  # ...and the first still waits
        gate.set()
        await until(lambda: sorted(taken) == ["s1", "s2"], what="both handoffs taken")
        assert all(e.error is None for ev in events.values() for e in ev.got)
    await sender.close()
