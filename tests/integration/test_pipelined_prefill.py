"""A pipelined prefill between live instances: prefill instances each run a stage of the
model's layers (StageJob), hand each chunk's hidden states on over the data plane
(StageHop), and the last stage samples the first token and hands decode every stage's KV
slice. Real NATS, real TCP, a random-weight model: the tokens are one engine's, and a
stage that is gone ends the request with the retryable error the gateway re-places on."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.decode.args import DecodeSettings
from services.decode.handlers import DecodeInstance
from services.gateway.streams import RETRYABLE
from services.prefill.args import PrefillSettings
from services.prefill.handlers import PrefillInstance
from shared import bus, errors, subjects
from shared.groups import group_holder
from shared.hashing import block_hashes
from shared.messages import DecodeJob, KVEvent, KVEventKind, StageJob, StageOpened, StageRef
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender
from tests.factories import tiny_llama
from tests.integration.test_instance_faults import Events, gen, nc, reference, running
from tests.integration.test_streamed_handoff import Spy

__all__ = ["nc"]  # the fixture, imported for pytest

CHUNK = 32
LONG = [(11 * i) % 290 + 1 for i in range(120)]  # 4 chunks of 32
SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(layers=4)


@contextlib.asynccontextmanager
async def group(nc, lm, tag: str, stages: int):
    """`stages` prefill instances and a decode instance, subscribed as __main__ does."""
    senders, prefills = [], []
    for i in range(stages):
        sender = TcpKVSender()
        await sender.start()
        senders.append(sender)
        settings = PrefillSettings(
            instance_id=f"p{i}-{tag}",
            kv_cache_gb=4 / 1024,
            stage_kv_gb=4 / 1024,
            chunk_tokens=CHUNK,
            transfer_timeout_s=5.0,
        )
        prefills.append(PrefillInstance(settings, nc, lm, sender, TcpKVReceiver()))
    dec = DecodeInstance(
        DecodeSettings(instance_id=f"d-{tag}", kv_cache_gb=4 / 1024, transfer_timeout_s=5.0),
        nc,
        lm,
        TcpKVReceiver(),
    )
    jobs = Spy(DecodeJob)
    async with contextlib.AsyncExitStack() as stack:
        for inst in [*prefills, dec]:
            await stack.enter_async_context(running(inst))
        subs = []
        for p in prefills:
            subs.append(
                await nc.subscribe(subjects.prefill_stage(p.instance_id), cb=p.stages.on_stage)
            )
            subs.append(await nc.subscribe(subjects.prefill_hop(p.instance_id), cb=p.stages.on_hop))
        await nc.subscribe(subjects.decode_submit(dec.instance_id), cb=jobs.on_msg)
        await nc.subscribe(subjects.decode_submit(dec.instance_id), cb=dec.on_submit)
        yield prefills, dec, jobs, subs
    for sender in senders:
        await sender.close()


def stage_jobs(req, prefills, dec, split, start: int = 0) -> list[StageJob]:
    refs = [
        StageRef(instance_id=p.instance_id, first_layer=a, end_layer=b)
        for p, (a, b) in zip(prefills, split, strict=True)
    ]
    return [
        StageJob(request=req, stages=refs, index=i, decode_id=dec.instance_id, start_tokens=start)
        for i in range(len(refs))
    ]


async def start(nc, jobs: list[StageJob]) -> list[int]:
    """Each stage opened, the last first, stage 0 (which starts computing) at the end, as
    the conductor does; their prefix hits."""
    hits = []
    for job in reversed(jobs):
        opened = await bus.request(
            nc, subjects.prefill_stage(job.me.instance_id), job, StageOpened, 5.0
        )
        hits.append(opened.hit_tokens)
    return hits[::-1]


@pytest.mark.parametrize("stages", [2, 3])
async def test_a_pipelined_prefill_gives_one_engines_tokens(nc, lm, stages):
    ref = reference(lm, LONG)
    events = Events()
    rid = f"cpp{stages}"
    await nc.subscribe(subjects.tokens(rid), cb=events.on_msg)
    kv_events = Spy(KVEvent)
    await nc.subscribe(subjects.KV_EVENTS, cb=kv_events.on_msg)
    async with group(nc, lm, f"ok{stages}", stages) as (prefills, dec, jobs, _):
        assert (
            await start(nc, stage_jobs(gen(rid, LONG), prefills, dec, SPLITS[stages]))
            == [0] * stages
        )
        await asyncio.wait_for(events.finished.wait(), 60)
        # Again: every stage's pool holds the prompt's full blocks now (7 of 16 tokens).
        again, events2 = f"{rid}-again", Events()
        await nc.subscribe(subjects.tokens(again), cb=events2.on_msg)
        hits = await start(
            nc, stage_jobs(gen(again, LONG), prefills, dec, SPLITS[stages], start=112)
        )
        await asyncio.wait_for(events2.finished.wait(), 60)
    assert [t for e in events.got for t in e.token_ids] == ref
    assert [t for e in events2.got for t in e.token_ids] == ref
    assert all(e.error is None for e in events.got + events2.got)
    assert events.got[0].instance_id == prefills[-1].instance_id  # the last stage's token
    assert hits == [112] * stages
    first, second = jobs.got
    assert first.kv is None and len(first.kv_slices) == stages
    assert all(h.num_tokens == len(LONG) for h in first.kv_slices)
    assert second.cached_tokens == 112 and events2.got[-1].usage.cached_tokens == 112
    # Each stage published the prompt's 7 full blocks under the group's holder id.
    holder = group_holder(
        [(p.instance_id, split) for p, split in zip(prefills, SPLITS[stages], strict=True)]
    )
    stored = [
        e
        for e in kv_events.got
        if e.kind == KVEventKind.STORED and e.instance_id.startswith("group:")  # not decode's
    ]
    assert {e.instance_id for e in stored} == {holder}
    full = block_hashes(LONG, 16)
    assert len(full) == 7 and sorted(h for e in stored for h in e.block_hashes) == sorted(
        full * stages
    )


async def test_a_stage_that_is_gone_ends_the_request_retryably(nc, lm):
    events = Events()
    await nc.subscribe(subjects.tokens("gone"), cb=events.on_msg)
    async with group(nc, lm, "gone", 2) as (prefills, dec, jobs, subs):
        jobs_ = stage_jobs(gen("gone", LONG), prefills, dec, SPLITS[2])
        await bus.request(
            nc, subjects.prefill_stage(prefills[1].instance_id), jobs_[1], StageOpened, 5.0
        )
        for sub in subs[2:]:  # stage 1 stops answering its hops
            await sub.unsubscribe()
        await bus.request(
            nc, subjects.prefill_stage(prefills[0].instance_id), jobs_[0], StageOpened, 5.0
        )
        await asyncio.wait_for(events.finished.wait(), 30)
        await asyncio.sleep(0)
    (event,) = events.got
    assert event.error is not None and event.error.code in RETRYABLE
    assert not jobs.got
    for p in prefills:  # nothing left held: each stage's blocks back in its pool
        assert not p.stages.runs


async def test_a_stage_job_it_cannot_run_is_refused_by_name(nc, lm):
    async with group(nc, lm, "bad", 2) as (prefills, dec, _, _):
        req = gen("bad", LONG)
        job = stage_jobs(req, prefills, dec, SPLITS[2])[1]
        with_logprobs = req.model_copy(
            update={"sampling": req.sampling.model_copy(update={"logprobs": 2})}
        )
        cases = {
            "does not take logprobs": job.model_copy(update={"request": with_logprobs}),
            "start_tokens 100": job.model_copy(update={"start_tokens": 100}),
            "stage 0 is": job.model_copy(update={"index": 0}),
        }
        for why, bad in cases.items():
            with pytest.raises(errors.HalfmoonError, match=why):
                await bus.request(
                    nc, subjects.prefill_stage(prefills[1].instance_id), bad, StageOpened, 5.0
                )
        assert not prefills[1].stages.runs
