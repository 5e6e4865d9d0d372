"""The registry keeps its live lists and the views derived from each instance between
decisions (for large clusters); what it answers must be what it would work out afresh.

A seeded random run of heartbeats (new, repeated, draining, returning after silence),
dispatches, expiries and queries at times that mostly move forward (and sometimes back)
checks every answer against a plain filter over the instances and views built from
scratch."""

from __future__ import annotations

import random

from services.conductor import snapshot
from services.conductor.costmodel import CostModel
from services.conductor.registry import Registry
from shared.messages import InstanceInfo, Role

EXPIRY_S = 3.0


def info(rng: random.Random, iid: str) -> InstanceInfo:
    role = Role.PREFILL if iid.startswith("p") else Role.DECODE
    running = rng.randrange(8)
    return InstanceInfo(
        instance_id=iid,
        role=role,
        status="draining" if rng.random() < 0.1 else "ready",
        queue_prompts=[rng.randrange(1, 4096) for _ in range(rng.randrange(3))],
        running=running,
        mean_context=float(rng.randrange(1, 4000)) if running else 0.0,
        kv_blocks_total=512,
        kv_blocks_free=rng.randrange(513),
    )


def fresh_alive(reg: Registry, role: Role, now: float) -> list[str]:
    return [
        s.info.instance_id
        for s in reg.all()
        if s.info.role == role and s.info.status == "ready" and now - s.last_seen <= EXPIRY_S
    ]


def fields(view) -> tuple:  # type: ignore[no-untyped-def]
    return (view.instance_id, view.queue_s, view.running, view.mean_context, view.load,
            view.kv_blocks_free)  # fmt: skip


def test_kept_lists_and_views_are_what_a_fresh_look_gives():
    rng = random.Random(3)
    reg, cost = Registry(expiry_s=EXPIRY_S), CostModel()
    ids = [f"p{i}" for i in range(12)] + [f"d{i}" for i in range(6)]
    now, checks = 0.0, 0
    for _ in range(3000):
        now += rng.choice([0.0, 0.0, 0.01, 0.5, 1.0, 2.9, 3.0, -0.5])
        op = rng.random()
        iid = rng.choice(ids)
        if op < 0.4:
            reg.seen(info(rng, iid), now)
        elif op < 0.6:
            reg.dispatched(iid, rng.random(), tokens=rng.randrange(100), blocks=rng.randrange(4))
        elif op < 0.62:
            reg.expire(now)
        for role in (Role.PREFILL, Role.DECODE):
            live = reg.alive(role, now)
            assert [s.info.instance_id for s in live] == fresh_alive(reg, role, now)
            snap = snapshot.build(live, live, cost, 1.5)
            for state, kept in zip(live, snap.prefills):
                state.prefill_view = None
                assert fields(kept) == fields(snapshot.prefill_view(state, cost))
            for state, kept in zip(live, snap.decodes):
                state.decode_view = None
                assert fields(kept) == fields(snapshot.decode_view(state))
            checks += len(live)
    assert checks > 3000  # the run exercised many live instances, not an empty registry


def test_a_dispatch_shows_in_the_next_decision_and_a_heartbeat_resets_it():
    reg, cost = Registry(expiry_s=EXPIRY_S), CostModel()
    base = InstanceInfo(instance_id="p0", role=Role.PREFILL, queue_prompts=[1000])
    reg.seen(base, 0.0)
    (before,) = snapshot.build(reg.alive(Role.PREFILL, 0.0), [], cost, 1.5).prefills
    reg.dispatched("p0", 0.25)
    (after,) = snapshot.build(reg.alive(Role.PREFILL, 0.1), [], cost, 1.5).prefills
    assert after.queue_s == before.queue_s + 0.25 and after.load == before.load + 1
    reg.seen(base, 0.2)  # the heartbeat's queue now includes the dispatched job
    (beat,) = snapshot.build(reg.alive(Role.PREFILL, 0.2), [], cost, 1.5).prefills
    assert beat.queue_s == before.queue_s and beat.load == before.load


def test_a_failed_dispatch_taken_back_after_a_heartbeat_leaves_the_views_whole():
    reg = Registry(expiry_s=EXPIRY_S)
    idle = InstanceInfo(instance_id="d0", role=Role.DECODE, kv_blocks_total=64, kv_blocks_free=64)
    reg.seen(idle, 0.0)
    reg.dispatched("d0", 0.5, tokens=100, blocks=8)
    reg.seen(idle, 0.1)  # the heartbeat: the job never arrived
    reg.dispatched("d0", -0.5, tokens=-100, count=-1, blocks=-8)  # the dispatch failed
    (view,) = snapshot.build([], reg.alive(Role.DECODE, 0.2), CostModel(), 1.5).decodes
    assert (view.running, view.mean_context, view.kv_blocks_free) == (0, 0.0, 64)
    assert reg.alive(Role.DECODE, 0.2)[0].load == 0


def test_an_instance_drops_out_when_its_heartbeat_expires_and_comes_back_with_one():
    reg = Registry(expiry_s=EXPIRY_S)
    reg.seen(InstanceInfo(instance_id="p0", role=Role.PREFILL), 0.0)
    reg.seen(InstanceInfo(instance_id="p1", role=Role.PREFILL), 2.0)
    assert [s.info.instance_id for s in reg.alive(Role.PREFILL, 2.5)] == ["p0", "p1"]
    assert [s.info.instance_id for s in reg.alive(Role.PREFILL, 3.5)] == ["p1"]
    assert reg.seen(InstanceInfo(instance_id="p0", role=Role.PREFILL), 4.0)  # back
    assert [s.info.instance_id for s in reg.alive(Role.PREFILL, 4.0)] == ["p0", "p1"]
    reg.seen(InstanceInfo(instance_id="p1", role=Role.PREFILL, status="draining"), 4.1)
    assert [s.info.instance_id for s in reg.alive(Role.PREFILL, 4.1)] == ["p0"]
