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
from shared.messages import (
    Ack,
    InstanceInfo,
    Placement,
    PrefillJob,
    Role,
)
from tests.factories import request
from tests.waiting import until


@pytest.fixture
async def cluster(nats_url):
    nc = await nats.connect(nats_url)
    settings = ConductorSettings(nats_url=nats_url, heartbeat_expiry_s=1.0, dispatch_timeout_s=1.0)
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
