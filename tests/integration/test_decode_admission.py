"""Decode admission: KV slots are reserved before a transfer starts (SGLang's prealloc queue).

A decode instance whose pool holds two requests gets six handoffs from a real prefill
instance over real NATS and TCP: it fetches no more than it can place, queues the rest
without fetching them, takes them as blocks free up, and every request ends with the
tokens transformers would give. A full queue refuses further handoffs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sized

import pytest

from services.decode.args import DecodeSettings
from services.decode.handlers import DecodeInstance
from services.prefill.args import PrefillSettings
from services.prefill.handlers import PrefillInstance
from shared import bus, errors, subjects
from shared.engine.connector import HandOffAll
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams as EngineParams
from shared.messages import Ack, DecodeJob, PrefillJob
from shared.transfer.base import HANDOFF
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender
from tests.integration.test_instance_faults import (
    PROMPT,
    TOKENS,
    Events,
    gen,
    nc,
    params,
    reference,
    running,
    tiny,
)
from tests.waiting import until

BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x dim x block x fp32


class RecordingReceiver(TcpKVReceiver):
    """The real receiver, noting which transfers decode started, and as each one started,
    how many handoffs still waited in decode's queue and how many were still unfinished."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched: list[str] = []
        self.waiting_at_fetch: list[int] = []
        self.unfinished_at_fetch: list[int] = []
        self.queue: Sized = ()
        self.streams: Sized = ()

    async def fetch(self, handle, timeout_s, purpose=HANDOFF):  # type: ignore[no-untyped-def,override]
        self.fetched.append(handle.transfer_id)
        self.waiting_at_fetch.append(len(self.queue))
        self.unfinished_at_fetch.append(len(self.streams))
        return await super().fetch(handle, timeout_s, purpose)


def offered_handoff(maker: LLMEngine, sender: TcpKVSender, rid: str) -> DecodeJob:
    """PROMPT prefilled by `maker` (a prefill engine), its KV offered by `sender`: the
    job a prefill instance would give decode."""
    maker.add_request(rid, PROMPT, EngineParams.of(params()))
    out = maker.step()[0]
    while out.handoff is None:
        out = maker.step()[0]
    handle = sender.offer(
        HANDOFF,
        out.handoff.meta.model_dump_json().encode(),
        out.handoff.payload(),
        out.handoff.meta.num_tokens,
        ttl_s=30.0,
    )
    return DecodeJob(
        request=gen(rid),
        prefill_id="p",
        kv=handle,
        output_token_ids=out.new_token_ids,
        events_sent=1,
    )


async def test_a_full_pool_queues_handoffs_unfetched_and_takes_them_as_blocks_free(nc, tiny):
    # Six different prompts, so no request shares another's blocks and the pool's room is
    # exact: 40 tokens + 8 are 3 blocks each, and 7 blocks hold two requests at a time.
    prompts = {f"q{i}": [200 + i, *PROMPT[1:]] for i in range(6)}
    sender, receiver = TcpKVSender(), RecordingReceiver()
    await sender.start()
    dec = DecodeInstance(
        DecodeSettings(
            instance_id="decode-small", kv_cache_gb=7 * BLOCK_BYTES / 2**30, transfer_timeout_s=30.0
        ),
        nc,
        tiny,
        receiver,
    )
    pre = PrefillInstance(
        PrefillSettings(instance_id="prefill-big", kv_cache_gb=4 / 1024, transfer_timeout_s=30.0),
        nc,
        tiny,
        sender,
        TcpKVReceiver(),
    )
    assert dec.engine.blocks.num_blocks == 7
    events = {rid: Events() for rid in prompts}
    for rid, ev in events.items():
        await nc.subscribe(subjects.tokens(rid), cb=ev.on_msg)
    receiver.queue, receiver.streams = dec.queue, dec.streams
    async with running(pre):
        await nc.subscribe(subjects.decode_submit("decode-small"), cb=dec.on_submit)
        await nc.subscribe(subjects.prefill_submit("prefill-big"), cb=pre.on_submit)
        for rid in events:
            await bus.request(
                nc,
                subjects.prefill_submit("prefill-big"),
                PrefillJob(request=gen(rid, prompts[rid]), decode_id="decode-small"),
                Ack,
                5.0,
            )
        # Decode is not stepping yet: the two that fit are reserved and fetched as they
        # arrive, the other four queue up unfetched. (Were it stepping, the tiny model
        # would finish each before prefill sent the next, and the pool would never fill.)
        await until(lambda: len(receiver.fetched) == 2 and len(dec.queue) == 4, 60.0)
        await until(lambda: dec.engine.blocks.num_free_blocks == 1, 60.0)  # 2 x 3 blocks
        assert all(j.kv is not None and j.kv.transfer_id not in receiver.fetched for j in dec.queue)

        async def watch_until_all_finish() -> None:
            while any(not ev.finished.is_set() for ev in events.values()):
                held = dec.engine.blocks.num_blocks - dec.engine.blocks.num_free_blocks
                assert held <= 7
                for job in list(dec.queue):
                    assert job.kv is not None and job.kv.transfer_id not in receiver.fetched
                await asyncio.sleep(0.005)

        async with running(dec):
            # The pool holds two: the rest wait in the queue, their KV still on prefill.
            await asyncio.wait_for(watch_until_all_finish(), 60)
    await sender.close()
    # Two fit at first, fetched on arrival; each later one started, in arrival order, as
    # blocks freed.
    assert receiver.waiting_at_fetch[2:] == [3, 2, 1, 0], receiver.waiting_at_fetch
    # The k-th fetch (from 0) waited until k - 1 requests had finished and freed blocks.
    for k, unfinished in enumerate(receiver.unfinished_at_fetch):
        assert unfinished <= 6 - max(0, k - 1), receiver.unfinished_at_fetch
    assert len(receiver.fetched) == 6  # each fetched once, when it had room
    for rid, ev in events.items():
        tokens = [t for e in ev.got for t in e.token_ids]
        assert tokens == reference(tiny, prompts[rid]), (
            rid
        )  # the first from prefill, the rest from decode
        assert ev.got[-1].usage is not None and ev.got[-1].usage.completion_tokens == TOKENS
    assert not dec.queue and not dec.engine.reserved and dec.info().kv_blocks_leased == 0
    # each handoff told the cost model how long it took, first token to KV in place
    handoffs = [s for s in dec.engine.cost_samples if s.kind == "handoff"]
    assert len(handoffs) == 6 and all(s.tokens == 40 and 0 < s.seconds < 60 for s in handoffs)


async def test_a_full_handoff_queue_refuses_with_a_clear_error(nc, tiny):
    """With the queue's bound at one and a pool of one request's blocks, not stepping: the
    first handoff is reserved at once, the second queues for room, and the third is
    refused, naming why."""
    sender = TcpKVSender()
    await sender.start()
    maker = LLMEngine(tiny, EngineConfig(kv_cache_bytes=4 << 20), connector=HandOffAll())
    jobs = [offered_handoff(maker, sender, f"f{i}") for i in range(3)]
    dec = DecodeInstance(
        DecodeSettings(
            instance_id="decode-one",
            kv_cache_gb=3 * BLOCK_BYTES / 2**30,
            transfer_timeout_s=30.0,
            max_queued_handoffs=1,
            max_num_seqs=1,
        ),
        nc,
        tiny,
        TcpKVReceiver(),
    )
    await nc.subscribe(subjects.decode_submit("decode-one"), cb=dec.on_submit)
    # not serving yet: nothing frees the first one's blocks, so the queue's bound answers
    for job in jobs[:2]:
        await bus.request(nc, subjects.decode_submit("decode-one"), job, Ack, 5.0)
    with pytest.raises(errors.HalfmoonError, match="decode handoff queue is full"):
        await bus.request(nc, subjects.decode_submit("decode-one"), jobs[2], Ack, 5.0)
    assert [j.request.request_id for j in dec.queue] == ["f1"]
    # f0 was reserved on arrival; its fetch and import end with it in the batch. (Read
    # without the engine's lock, so only its final state is waited for: mid-import it is
    # briefly in neither dict.)
    await until(lambda: "f0" in dec.engine.requests, timeout_s=30.0)
    assert [j.request.request_id for j in dec.queue] == ["f1"]
    dec.close_engine()
    await sender.close()


def test_samples_of_one_prompt_share_its_blocks_on_decode(tiny):
    """Two handoffs of the same prompt (n=2): the second reservation takes the first's
    cached full blocks instead of new ones, and both continue exactly."""
    maker = LLMEngine(tiny, EngineConfig(kv_cache_bytes=4 << 20), connector=HandOffAll())
    dec = LLMEngine(tiny, EngineConfig(kv_cache_bytes=4 << 20))
    ref = reference(tiny)
    used = []
    for rid in ("s0", "s1"):
        maker.add_request(rid, PROMPT, EngineParams.of(params()))
        out = None
        while out is None or out.handoff is None:
            out = maker.step()[0]
        free = dec.blocks.num_free_blocks
        assert dec.reserve(
            rid, PROMPT, out.new_token_ids, EngineParams.of(params()), out.handoff.meta.num_tokens
        )
        used.append(free - dec.blocks.num_free_blocks)
        dec.add_reserved(rid, out.handoff, out.new_token_ids)
    assert used == [3, 1]  # 40 tokens: 3 blocks, of which the 2 full ones are shared
    tokens: dict[str, list[int]] = {"s0": [ref[0]], "s1": [ref[0]]}
    while dec.has_work():
        for o in dec.step():
            tokens[o.request_id] += o.new_token_ids
    assert tokens == {"s0": ref, "s1": ref}


async def test_a_handoff_goes_in_beside_the_step_in_flight(nc, tiny):
    """Reserving and importing a handoff run on decode's importer thread: with the engine
    thread held (as a long step holds it), the request is reserved, fetched and in the
    batch before the step ends, so it decodes at the very next step. On the engine thread
    it waited for this step to end to be reserved and for the next one to go in."""
    sender = TcpKVSender()
    await sender.start()
    maker = LLMEngine(tiny, EngineConfig(kv_cache_bytes=4 << 20), connector=HandOffAll())
    job = offered_handoff(maker, sender, "h0")
    dec = DecodeInstance(
        DecodeSettings(instance_id="decode-beside", kv_cache_gb=4 / 1024, transfer_timeout_s=30.0),
        nc,
        tiny,
        TcpKVReceiver(),
    )
    events = Events()
    await nc.subscribe(subjects.tokens("h0"), cb=events.on_msg)
    gate = threading.Event()
    async with running(dec):
        await nc.subscribe(subjects.decode_submit("decode-beside"), cb=dec.on_submit)
        held = asyncio.create_task(dec.run_engine(gate.wait, 30.0))  # the "long step"
        await bus.request(nc, subjects.decode_submit("decode-beside"), job, Ack, 5.0)
        await until(lambda: "h0" in dec.engine.requests, timeout_s=30.0)
        assert not gate.is_set() and not held.done()  # in, while the engine thread is held
        assert not dec.queue and not dec.engine.reserved
        gate.set()
        await held
        await asyncio.wait_for(events.finished.wait(), 30)
    tokens = job.output_token_ids + [t for e in events.got for t in e.token_ids]
    assert tokens == reference(tiny)
    await sender.close()
