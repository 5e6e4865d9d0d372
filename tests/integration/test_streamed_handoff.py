"""A long prompt's KV streamed to decode while prefill computes it, between a real prefill
and a real decode instance over real NATS and TCP, on a random-weight model.

The prompt runs in several chunks; after each, its full blocks go to decode, and the
handoff after the first token carries only what is left. The tokens are the same as one
engine's. A stream that cannot start (no room on decode) falls back to the whole KV with
the first token; a cancel mid-stream frees the blocks on both sides; a decode instance
that dies mid-stream ends the request with the retryable error the gateway re-places on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from services.decode.args import DecodeSettings
from services.decode.handlers import DecodeInstance
from services.gateway.streams import RETRYABLE
from services.prefill.args import PrefillSettings
from services.prefill.handlers import PrefillInstance
from services.worker.instance import EngineInstance
from shared import bus, subjects
from shared.messages import Ack, CancelRequest, DecodeJob, KVChunk, PrefillJob
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender
from tests.integration.test_decode_admission import BLOCK_BYTES
from tests.integration.test_instance_faults import (
    Events,
    gen,
    nc,
    reference,
    running,
    tiny,
)
from tests.waiting import until

CHUNK = 32
LONG = [(7 * i) % 290 + 1 for i in range(120)]  # 4 chunks of 32: 7 full blocks and a part


class Spy:
    """Every message on a subject, beside the instance that answers it."""

    def __init__(self, cls):  # type: ignore[no-untyped-def]
        self.cls, self.got = cls, []

    async def on_msg(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.got.append(self.cls.model_validate_json(msg.data))


@contextlib.asynccontextmanager
async def cluster(
    nc, tiny, tag: str, stream: bool = True, decode_blocks: int = 64, reuse: bool = True
):
    """A prefill and a decode instance, subscribed as their __main__ subscribes them, and
    spies on the chunks and handoffs between them."""
    sender = TcpKVSender()
    await sender.start()
    pre = PrefillInstance(
        PrefillSettings(
            instance_id=f"prefill-{tag}",
            kv_cache_gb=4 / 1024,
            chunk_tokens=CHUNK,
            stream_handoff=stream,
            decode_reuse=reuse,
            transfer_timeout_s=10.0,
        ),
        nc,
        tiny,
        sender,
        TcpKVReceiver(),
    )
    dec = DecodeInstance(
        DecodeSettings(
            instance_id=f"decode-{tag}",
            kv_cache_gb=decode_blocks * BLOCK_BYTES / 2**30,
            transfer_timeout_s=10.0,
        ),
        nc,
        tiny,
        TcpKVReceiver(),
    )
    chunks, jobs = Spy(KVChunk), Spy(DecodeJob)
    async with running(pre), running(dec):
        await nc.subscribe(subjects.prefill_submit(pre.instance_id), cb=pre.on_submit)
        decode_subs = [  # what a dead decode instance no longer answers
            await nc.subscribe(subjects.decode_stream(dec.instance_id), cb=chunks.on_msg),
            await nc.subscribe(subjects.decode_submit(dec.instance_id), cb=jobs.on_msg),
            await nc.subscribe(subjects.decode_submit(dec.instance_id), cb=dec.on_submit),
            await nc.subscribe(subjects.decode_stream(dec.instance_id), cb=dec.kv_holds.on_chunk),
            await nc.subscribe(subjects.decode_hold(dec.instance_id), cb=dec.kv_holds.on_hold),
        ]
        yield pre, dec, chunks, jobs, decode_subs
    await sender.close()


async def submit(nc, pre: PrefillInstance, dec: DecodeInstance, rid: str, prompt=LONG):
    job = PrefillJob(request=gen(rid, prompt), decode_id=dec.instance_id)
    await bus.request(nc, subjects.prefill_submit(pre.instance_id), job, Ack, 5.0)


def hold_after(inst: EngineInstance, steps: int) -> threading.Event:
    """Hold the engine thread before its step `steps` + 1 (a long chunk in flight) until
    the event is set."""
    gate, real, count = threading.Event(), inst.engine.step, [0]

    def step(between=None):  # type: ignore[no-untyped-def]
        count[0] += 1
        if count[0] > steps:
            gate.wait(30)
        return real(between)

    inst.engine.step = step  # type: ignore[method-assign]
    return gate


def paced(pre: PrefillInstance) -> None:
    """Each prefill step waits for the chunk in flight to be acked, as on a real prompt,
    where a chunk takes far longer to compute than its blocks take to move. (This model's
    steps take a millisecond, and the stream would coalesce chunks at random.)"""
    real = pre.engine.step

    def step(between=None):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 30
        while any(out.busy for out in list(pre.kv_streams.outgoing.values())):
            assert time.monotonic() < deadline, "a chunk was never acked"
            time.sleep(0.001)
        return real(between)

    pre.engine.step = step  # type: ignore[method-assign]


async def idle(pre: PrefillInstance, dec: DecodeInstance) -> None:
    await until(
        lambda: (
            not dec.streams
            and not dec.kv_holds.pending
            and not dec.engine.reserved
            and not pre.kv_streams.outgoing
            and pre.info().kv_blocks_leased == 0
        ),
        what="both instances holding nothing",
    )


@pytest.mark.parametrize("stream", [True, False])
async def test_a_long_prompt_streams_to_decode_and_its_tokens_are_exact(nc, tiny, stream):
    ref = reference(tiny, LONG)
    events = Events()
    await nc.subscribe(subjects.tokens("s1"), cb=events.on_msg)
    async with cluster(nc, tiny, f"st{int(stream)}", stream) as (pre, dec, chunks, jobs, _):
        paced(pre)
        await submit(nc, pre, dec, "s1")
        await asyncio.wait_for(events.finished.wait(), 30)
        await idle(pre, dec)
    assert [t for e in events.got for t in e.token_ids] == ref
    assert all(e.error is None for e in events.got)
    (job,) = jobs.got
    if not stream:  # the old path: everything after the first token
        assert not chunks.got and job.held_blocks == 0
        return
    # Three chunks' blocks went ahead (2, 2 and 2 full blocks of 16, after steps 1-3), into
    # the blocks the stream's hold reserved before any KV came.
    assert len(chunks.got) == 3
    assert job.held_blocks == 6
    assert job.kv is not None and job.kv.num_tokens == len(LONG)
    handoff = [s for s in dec.engine.cost_samples if s.kind == "handoff"]
    assert [s.tokens for s in handoff] == [len(LONG) - 6 * 16]  # what moved after the token


async def test_a_chunk_in_flight_at_the_first_token_is_not_sent_again(nc, tiny):
    """The last step runs while the third chunk is still on its way: decode holds it back
    until the first token is out. The handoff waits for that chunk's ack and carries only
    the blocks after it, where it used to send the chunk's blocks a second time."""
    ref = reference(tiny, LONG)
    events = Events()
    first_token = threading.Event()

    async def on_token(msg) -> None:  # type: ignore[no-untyped-def]
        first_token.set()

    await nc.subscribe(subjects.tokens("s9"), cb=events.on_msg)
    await nc.subscribe(subjects.tokens("s9"), cb=on_token)
    async with cluster(nc, tiny, "inflight") as (pre, dec, chunks, jobs, _):
        fills, real_fill = [0], dec.engine.fill_reserved

        def fill(rid, kv):  # type: ignore[no-untyped-def]
            fills[0] += 1
            if fills[0] == 3:  # the importer thread: holding it holds the chunk's ack
                assert first_token.wait(30), "no first token while the chunk was held"
            return real_fill(rid, kv)

        dec.engine.fill_reserved = fill  # type: ignore[method-assign]
        steps, real_step = [0], pre.engine.step

        def step(between=None):  # type: ignore[no-untyped-def]
            steps[0] += 1
            deadline = time.monotonic() + 30
            # Steps 2 and 3 wait for the chunk before them, as on a real prompt; the last
            # one (4) runs with the third chunk in flight.
            while steps[0] <= 3 and any(o.busy for o in list(pre.kv_streams.outgoing.values())):
                assert time.monotonic() < deadline, "a chunk was never acked"
                time.sleep(0.001)
            if steps[0] == 4:
                assert until_busy(pre), "the third chunk never left"
            return real_step(between)

        pre.engine.step = step  # type: ignore[method-assign]
        await submit(nc, pre, dec, "s9")
        await asyncio.wait_for(events.finished.wait(), 30)
        await idle(pre, dec)
    assert [t for e in events.got for t in e.token_ids] == ref
    assert len(chunks.got) == 3 and fills[0] == 3
    (job,) = jobs.got
    assert job.held_blocks == 6  # the held chunk counted: nothing sent twice
    handoff = [s for s in dec.engine.cost_samples if s.kind == "handoff"]
    assert [s.tokens for s in handoff] == [len(LONG) - 6 * 16]


def until_busy(pre: PrefillInstance) -> bool:
    """Engine thread: wait until a chunk is on its way (the third, after step 3)."""
    deadline = time.monotonic() + 30
    while not any(o.busy for o in list(pre.kv_streams.outgoing.values())):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


async def test_a_stream_decode_has_no_room_for_falls_back_to_the_whole_kv(nc, tiny):
    """Decode's pool holds one long request at a time: the first stream reserves it, the
    second's hold is refused, holding nothing, and its KV goes whole with its first token,
    queued until the first request frees the pool."""
    prompts = {"f1": LONG, "f2": [3, *LONG[1:]]}
    refs = {rid: reference(tiny, p) for rid, p in prompts.items()}
    events = {rid: Events() for rid in prompts}
    for rid, ev in events.items():
        await nc.subscribe(subjects.tokens(rid), cb=ev.on_msg)
    async with cluster(nc, tiny, "room", decode_blocks=12) as (pre, dec, chunks, jobs, _):
        held = hold_after(dec, 0)  # f1 decodes only once f2's stream was refused
        for rid, prompt in prompts.items():
            await submit(nc, pre, dec, rid, prompt)
        await until(
            lambda: (
                "f2" in pre.kv_streams.outgoing
                and pre.kv_streams.outgoing["f2"].stopped
                or any(j.request.request_id == "f2" for j in jobs.got)
            ),
            what="f2's stream refused",
        )
        held.set()
        for ev in events.values():
            await asyncio.wait_for(ev.finished.wait(), 60)
        await idle(pre, dec)
    for rid in prompts:
        assert [t for e in events[rid].got for t in e.token_ids] == refs[rid]
    by_id = {j.request.request_id: j for j in jobs.got}
    assert by_id["f1"].held_blocks > 0
    assert by_id["f2"].held_blocks == 0  # refused: all of it came after the first token
    assert "f2" not in [c.request_id for c in chunks.got]  # refused before any chunk


async def test_a_cancel_mid_stream_frees_the_blocks_on_both_sides(nc, tiny):
    async with cluster(nc, tiny, "cancel") as (pre, dec, chunks, jobs, _):
        paced(pre)
        gate = hold_after(pre, 2)
        await submit(nc, pre, dec, "c1")
        await until(
            lambda: (
                "c1" in dec.engine.reserved and dec.engine.reserved["c1"].num_computed_tokens == 64
            ),
            what="the first two steps' blocks in decode's reservation",
        )
        assert dec.info().kv_blocks_leased == 8  # the whole prompt reserved: 120 tokens
        await nc.publish(subjects.CANCEL, CancelRequest(request_id="c1").encode())
        await until(lambda: not dec.engine.reserved, what="decode's reservation freed")
        assert dec.info().kv_blocks_leased == 0 and not dec.kv_holds.pending
        gate.set()  # prefill's abort waits for its engine thread, held by the long step
        await until(lambda: not pre.engine.requests, what="prefill dropping it")
        await idle(pre, dec)
        info = dec.info()
        assert info.kv_blocks_free == info.kv_blocks_total
        assert not jobs.got  # no handoff for a cancelled request


async def test_decode_dying_mid_stream_ends_the_request_retryably(nc, tiny):
    """The decode instance goes away after the first chunk: the rest of the stream is
    refused, the handoff after the first token finds nobody, and the request ends with an
    error the gateway re-places on, as it did before streaming."""
    events = Events()
    await nc.subscribe(subjects.tokens("d1"), cb=events.on_msg)
    async with cluster(nc, tiny, "death") as (pre, dec, chunks, jobs, subs):
        gate = hold_after(pre, 2)
        await submit(nc, pre, dec, "d1")
        await until(lambda: "d1" in dec.kv_holds.pending, what="the stream open")
        for sub in subs:  # decode's subjects answer no more
            await sub.unsubscribe()
        gate.set()
        await asyncio.wait_for(events.finished.wait(), 30)
        await until(
            lambda: not pre.kv_streams.outgoing and pre.info().kv_blocks_leased == 0, what="idle"
        )
    last = events.got[-1]
    assert last.error is not None and last.error.code in RETRYABLE, last
