"""The conductor over a real nats-server: heartbeats in, placement and dispatch out.

Its neighbours (prefill and decode instances) are plain NATS subscribers here: the unit
under test is the conductor's registry, placement and dispatch.
"""

from __future__ import annotations

import time

import nats
import pytest

from services.conductor.args import ConductorSettings
from services.conductor.handlers import Conductor
from shared import bus, errors, subjects
from shared.kv_messages import KVMatchReply
from shared.messages import (
    Ack,
    InstanceInfo,
    Placement,
    PrefillJob,
    Role,
    StageClose,
    StageJob,
    StageOpened,
)
from tests.factories import request
from tests.waiting import until


@pytest.fixture
async def cluster(nats_url, request):
    nc = await nats.connect(nats_url)
    extra = getattr(request, "param", {})  # e.g. pipelined prefill's settings
    settings = ConductorSettings(
        nats_url=nats_url, heartbeat_expiry_s=1.0, dispatch_timeout_s=1.0, **extra
    )
    conductor = Conductor(settings, nc, records=None)
    subs = [
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=conductor.on_heartbeat),
        await nc.subscribe(subjects.CONDUCTOR_SCHEDULE, queue="c", cb=conductor.on_schedule),
    ]
    yield nc, conductor
    for s in subs:
        await s.unsubscribe()
    await nc.close()


async def beat(nc, iid, role, **kw):
    info = InstanceInfo(instance_id=iid, role=role, sent_at=time.time(), **kw)
    await nc.publish(subjects.heartbeat(role.value, iid), info.encode())


async def heard(conductor, *ids: str) -> None:
    """Until the conductor has handled these instances' heartbeats (callbacks run later),
    and with an expiry no slow machine reaches: these tests are not about expiry."""
    await until(
        lambda: {s.info.instance_id for s in conductor.registry.all()} >= set(ids),
        what=f"heartbeats of {ids}",
    )
    conductor.registry.expiry_s = 60.0


async def fake_prefill(nc, iid, jobs: list, accept=True):
    async def on_submit(msg):
        jobs.append(PrefillJob.model_validate_json(msg.data))
        await bus.respond(msg, Ack() if accept else errors.Rejected("full"))

    return await nc.subscribe(subjects.prefill_submit(iid), cb=on_submit)


async def test_places_and_dispatches(cluster):
    nc, conductor = cluster
    jobs: list[PrefillJob] = []
    sub = await fake_prefill(nc, "p0", jobs)
    await beat(nc, "p0", Role.PREFILL)
    await beat(nc, "d0", Role.DECODE)
    await heard(conductor, "p0", "d0")
    placement = await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, request("r1"), Placement, 2)
    assert (placement.prefill_id, placement.decode_id) == ("p0", "d0")
    assert [j.request.request_id for j in jobs] == ["r1"] and jobs[0].decode_id == "d0"
    await sub.unsubscribe()


async def test_a_prompt_goes_to_the_decode_instance_that_caches_it(cluster):
    """The KV manager's match names a decode instance holding 5 of the prompt's 6 blocks
    (it served the conversation's turn before): of two idle decode instances, that one
    gets the request, whose handoff there moves one block; with no match, the tie goes to
    the smaller id."""
    nc, conductor = cluster
    held: dict[str, int] = {"d1": 5}

    async def on_match(msg):
        await bus.respond(msg, KVMatchReply(matches={"p0": 0, **held}))

    subs = [await fake_prefill(nc, "p0", []), await nc.subscribe(subjects.KV_MATCH, cb=on_match)]
    for iid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        await beat(nc, iid, role)
    await heard(conductor, "p0", "d0", "d1")
    turn = request("t2", prompt=list(range(1, 97)), block_hashes=list(range(11, 17)))
    placement = await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, turn, Placement, 3)
    assert placement.decode_id == "d1"
    held.clear()
    other = turn.model_copy(update={"request_id": "t3"})
    placement = await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, other, Placement, 3)
    assert placement.decode_id == "d0"
    for sub in subs:
        await sub.unsubscribe()


async def test_refusing_prefill_falls_back_to_the_next(cluster):
    nc, conductor = cluster
    refused, taken = [], []
    subs = [
        await fake_prefill(nc, "busy", refused, accept=False),
        await fake_prefill(nc, "free", taken),
    ]
    await beat(nc, "busy", Role.PREFILL)  # least loaded, but it says no
    await beat(nc, "free", Role.PREFILL, queue_depth=3)
    await beat(nc, "d0", Role.DECODE)
    await heard(conductor, "busy", "free", "d0")
    placement = await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, request("r2"), Placement, 3)
    assert placement.prefill_id == "free" and len(refused) == 1 and len(taken) == 1
    for s in subs:
        await s.unsubscribe()


async def test_no_live_instances_is_unavailable(cluster):
    nc, conductor = cluster
    await beat(nc, "p9", Role.PREFILL)
    await beat(nc, "d9", Role.DECODE)
    await until(lambda: {s.info.instance_id for s in conductor.registry.all()} >= {"p9", "d9"})
    # They fall silent. Once every heartbeat heard (a stray heard earlier too) is older
    # than the expiry, nothing is live: a short expiry gets there without a fixed sleep.
    conductor.registry.expiry_s = 0.05
    await until(
        lambda: (
            not any(
                conductor.registry.alive(role, time.time()) for role in (Role.PREFILL, Role.DECODE)
            )
        )
    )
    with pytest.raises(errors.Unavailable, match="no live"):
        await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, request("r3"), Placement, 2)


async def fake_stage(nc, iid, got: list, accept=True):
    """A prefill instance's stage subjects: jobs and closes recorded, in arrival order."""

    async def on_stage(msg):
        got.append(StageJob.model_validate_json(msg.data))
        if accept is None:
            return  # silent: still building its pool when the conductor stops waiting
        await bus.respond(msg, StageOpened(hit_tokens=0) if accept else errors.Rejected("no"))

    async def on_close(msg):
        got.append(StageClose.model_validate_json(msg.data))
        await bus.respond(msg, Ack())

    return [
        await nc.subscribe(subjects.prefill_stage(iid), cb=on_stage),
        await nc.subscribe(subjects.prefill_stage_close(iid), cb=on_close),
    ]


GROUPS = {"max_stages": 2, "pipeline_min_tokens": 1024}
LONG = list(range(1, 3001))


@pytest.mark.parametrize("cluster", [GROUPS], indirect=True)
async def test_a_long_prompt_goes_to_a_group_of_idle_instances(cluster):
    nc, conductor = cluster
    got: list = []
    subs = [*await fake_stage(nc, "pa", got), *await fake_stage(nc, "pb", got)]
    for iid in ("pa", "pb"):
        await beat(nc, iid, Role.PREFILL)
    await beat(nc, "d0", Role.DECODE)
    await heard(conductor, "pa", "pb", "d0")
    req = request("long", prompt=LONG)
    placement = await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, req, Placement, 3)
    assert (placement.prefill_id, placement.decode_id) == ("pa", "d0")
    # The last stage opened first; both name the same group, split evenly by layers.
    assert [(j.index, j.me.instance_id) for j in got] == [(1, "pb"), (0, "pa")]
    layers = conductor.cost.num_layers
    half = layers // 2
    assert [(s.first_layer, s.end_layer) for s in got[0].stages] == [(0, half), (half, layers)]
    assert all(j.decode_id == "d0" and j.start_tokens == 0 for j in got)
    for s in subs:
        await s.unsubscribe()


@pytest.mark.parametrize("cluster", [GROUPS], indirect=True)
async def test_a_group_whose_stage_refuses_is_closed_and_one_instance_takes_it(cluster):
    nc, conductor = cluster
    stage_a: list = []
    stage_b: list = []
    single: list[PrefillJob] = []
    subs = [
        *await fake_stage(nc, "qa", stage_a, accept=False),  # stage 0 says no
        *await fake_stage(nc, "qb", stage_b),
        await fake_prefill(nc, "qb", single),
    ]
    for iid in ("qa", "qb"):
        await beat(nc, iid, Role.PREFILL)
    await beat(nc, "d1", Role.DECODE)
    await heard(conductor, "qa", "qb", "d1")
    req = request("long2", prompt=LONG)
    placement = await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, req, Placement, 3)
    assert placement.prefill_id == "qb" and [j.request.request_id for j in single] == ["long2"]
    assert [type(m).__name__ for m in stage_b] == ["StageJob", "StageClose"]  # let go first
    assert [type(m).__name__ for m in stage_a] == ["StageJob"]
    # Taken back: the group's predicted work is off both instances' queues but qb's job.
    qa = next(x for x in conductor.registry.all() if x.info.instance_id == "qa")
    assert qa.dispatched_since_beat == 0 and qa.pending_s == 0.0
    for s in subs:
        await s.unsubscribe()


@pytest.mark.parametrize("cluster", [{**GROUPS, "stage_open_timeout_s": 0.5}], indirect=True)
async def test_a_stage_silent_past_the_open_timeout_is_closed_too(cluster):
    """It may open the prompt after the conductor gave up on it: the close lets it go."""
    nc, conductor = cluster
    stage_a: list = []
    stage_b: list = []
    single: list[PrefillJob] = []
    subs = [
        *await fake_stage(nc, "ta", stage_a, accept=None),  # stage 0 never answers
        *await fake_stage(nc, "tb", stage_b),
        await fake_prefill(nc, "tb", single),
    ]
    for iid in ("ta", "tb"):
        await beat(nc, iid, Role.PREFILL)
    await beat(nc, "d2", Role.DECODE)
    await heard(conductor, "ta", "tb", "d2")
    req = request("long3", prompt=LONG)
    placement = await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, req, Placement, 5)
    assert placement.prefill_id == "tb" and [j.request.request_id for j in single] == ["long3"]
    assert [type(m).__name__ for m in stage_b] == ["StageJob", "StageClose"]
    await until(lambda: len(stage_a) == 2, what="the silent stage's close")
    assert [type(m).__name__ for m in stage_a] == ["StageJob", "StageClose"]
    for s in subs:
        await s.unsubscribe()
