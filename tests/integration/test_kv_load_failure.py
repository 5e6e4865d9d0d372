"""The KV-load failure policy (shared/kv_load.py) on real instances, a random-weight model,
real NATS and real TCP transfers: a prefix pull from an instance that is gone, and a
handoff whose prefill is gone, are recomputed under "recompute" (same tokens as without a
fault) and end the request with kv_load_failed under "fail"; each is counted by kind and
outcome. (The disk tier's faults: tests/integration/test_engine.py.)"""

from __future__ import annotations

import asyncio
import socket

import nats
import pytest

from services.decode.args import DecodeSettings
from services.decode.handlers import DecodeInstance
from services.prefill.args import PrefillSettings
from services.prefill.handlers import PrefillInstance
from shared import bus, subjects
from shared.kv_load import KVLoadFailurePolicy
from shared.messages import Ack, DecodeJob, KVHandle, PrefillJob
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender
from tests.factories import tiny_llama
from tests.integration.test_instance_faults import (
    TOKENS,
    Events,
    dead_handoff,
    gen,
    listen,
    reference,
    running,
)
from tests.waiting import until

POLICIES: tuple[KVLoadFailurePolicy, ...] = ("recompute", "fail")


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture
async def nc(nats_url):
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


def outcome(policy: KVLoadFailurePolicy) -> str:
    return "recomputed" if policy == "recompute" else "failed"


def check_end(events: Events, policy: KVLoadFailurePolicy, ref: list[int], first: int) -> None:
    last = events.got[-1]
    if policy == "recompute":
        assert last.error is None, last
        assert [t for e in events.got for t in e.token_ids] == ref[first:]
    else:
        assert last.error is not None and last.error.code == "kv_load_failed", last
        assert [t for e in events.got for t in e.token_ids] == []  # nothing more


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_failed_handoff(nc, tiny, policy):
    ref = reference(tiny)
    rid = f"handoff-{policy}"
    events = await listen(nc, rid)
    settings = DecodeSettings(
        instance_id=f"decode-{policy}",
        kv_cache_gb=4 / 1024,
        transfer_timeout_s=2.0,
        kv_load_failure=policy,
    )
    with dead_handoff("x" * 32) as gone:
        async with running(DecodeInstance(settings, nc, tiny, TcpKVReceiver())) as dec:
            job = DecodeJob(
                request=gen(rid),
                prefill_id="prefill-gone",
                kv=gone,
                output_token_ids=ref[:1],
                events_sent=1,
            )
            await dec.admit(job)
            await asyncio.wait_for(events.finished.wait(), 30)
            await until(lambda: not dec.engine.has_work(), what="the engine idle")
            free = dec.info()
            counts = dec.engine.kv_load_failures.counts
    check_end(events, policy, ref, 1)
    assert dict(counts) == {("handoff", outcome(policy)): 1}
    assert free.kv_blocks_free == free.kv_blocks_total and rid not in dec.streams


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_failed_prefix_pull(nc, tiny, policy):
    ref = reference(tiny)
    rid = f"pull-{policy}"
    events = await listen(nc, rid)
    sender = TcpKVSender()
    await sender.start()
    iid = f"prefill-{policy}"
    settings = PrefillSettings(
        instance_id=iid, kv_cache_gb=4 / 1024, transfer_timeout_s=2.0, kv_load_failure=policy
    )
    inst = PrefillInstance(settings, nc, tiny, sender, TcpKVReceiver())
    async with running(inst) as pre:
        await nc.subscribe(subjects.prefill_submit(iid), cb=pre.on_submit)
        req = gen(rid).model_copy(update={"block_hashes": [11, 22]})
        # The holder the conductor named is gone: nobody answers its export subject.
        job = PrefillJob(request=req, decode_id="", prefix_from="prefill-gone", prefix_blocks=2)
        await bus.request(nc, subjects.prefill_submit(iid), job, Ack, 5.0)
        await asyncio.wait_for(events.finished.wait(), 30)
        await until(lambda: not pre.engine.has_work() and not pre.intake, what="idle")
        counts = pre.engine.kv_load_failures.counts
    await sender.close()
    check_end(events, policy, ref, 0)
    if policy == "recompute":
        assert len(ref) == TOKENS
    assert dict(counts) == {("pull", outcome(policy)): 1}
    assert rid not in pre.streams and rid not in pre.decode_for
