"""Load samples through the real write path: heartbeats on a real nats-server, the
conductor's heartbeat handler, the RecordWriter, real SQL (SQLite; PostgreSQL if given),
read back by the console's queries.

The conductor's wall clock is the test's: each heartbeat arrives at a set time, and the
next is sent once the conductor has handled it, so which heartbeats share an interval
does not depend on how fast this machine runs the loop."""

from __future__ import annotations

import math
import time
import types

import nats
import pytest
from sqlalchemy import select

from console import history, queries
from services.conductor import handlers
from services.conductor.args import ConductorSettings
from services.conductor.handlers import Conductor
from shared import subjects
from shared.db import session as db
from shared.db.records import RecordWriter
from shared.db.schema import DecisionRecord, InstanceRecord, LoadSample, RequestRecord
from shared.messages import InstanceInfo, KVActivity, Role
from tests.waiting import until


async def _rows(engine) -> list[LoadSample]:
    async with db.sessionmaker(engine)() as s:
        return list((await s.execute(select(LoadSample).order_by(LoadSample.t))).scalars())


def handled(conductor: Conductor, instance_id: str, queue_depth: int) -> bool:
    return any(
        s.info.instance_id == instance_id and s.info.queue_depth == queue_depth
        for s in conductor.registry.all()
    )


async def test_heartbeats_become_load_samples(nats_url, db_url, monkeypatch):
    interval = 0.5
    # An interval boundary a little in the past (the console reads the last hour).
    base = math.floor(time.time() / interval) * interval - 10 * interval
    clock = types.SimpleNamespace(now=base)
    monkeypatch.setattr(
        handlers,
        "time",
        types.SimpleNamespace(
            time=lambda: clock.now, perf_counter=time.perf_counter, monotonic=time.monotonic
        ),
    )
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    nc = await nats.connect(nats_url)
    conductor = Conductor(
        ConductorSettings(nats_url=nats_url, instance_record_interval_s=interval),
        nc,
        records=writer,
    )
    sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=conductor.on_heartbeat)
    try:
        started = base
        for k in range(1, 17):  # 4 intervals of heartbeats, every quarter interval
            clock.now = base + (k - 1) * interval / 4
            info = InstanceInfo(
                instance_id="prefill-7",
                role=Role.PREFILL,
                started_at=started,
                queue_depth=k,
                running=1,
                kv_blocks_total=64,
                kv_blocks_free=60,
                kv_activity=KVActivity(transfers_out=k, bytes_out=1000 * k),
                sent_at=clock.now,
            )
            await nc.publish(subjects.heartbeat("prefill", "prefill-7"), info.encode())
            gateway = InstanceInfo(
                instance_id="gw", role=Role.GATEWAY, queue_depth=k, sent_at=clock.now
            )
            await nc.publish(subjects.heartbeat("gateway", "gw"), gateway.encode())
            # One subscription handles them in order: the gateway's beat comes last.
            await until(lambda k=k: handled(conductor, "gw", k), what=f"heartbeat {k}")
        await writer.flush()
        rows = await _rows(engine)
        assert {r.instance_id for r in rows} == {"prefill-7"}  # no samples of the gateway
        assert [(r.t, r.queue_depth) for r in rows] == [
            (base + i * interval, 1 + 4 * i) for i in range(4)
        ]  # each interval's first
        assert len({r.t for r in rows}) == len(rows)
        assert all(r.t % interval == 0 for r in rows)
        # Heartbeat k says queue_depth k and k transfers since its start. Each row is the first
        # heartbeat of its interval, with the transfers since the previous row: together, what
        # the last sampled heartbeat said.
        last = rows[-1].queue_depth
        assert rows[0].queue_depth == 1 and last >= 5
        assert sum(r.transfers_out for r in rows) == last
        assert sum(r.bytes_out for r in rows) == 1000 * last
        assert {(r.role, r.kv_blocks_used, r.running) for r in rows} == {("prefill", 4, 1)}
        assert [r.queue_depth for r in rows] == sorted(r.queue_depth for r in rows)
        snap = queries.load_snapshot(db_url, 3600.0)
        assert history.activity_totals(snap.samples)["transfers_out"] == last
    finally:
        await sub.unsubscribe()
        await nc.close()
        await writer.close()
        await engine.dispose()


async def test_two_conductors_one_row_and_old_samples_pruned(db_url):
    engine = db.make_engine(db_url)
    writers = [RecordWriter(engine, flush_interval_s=0.0) for _ in range(2)]
    settings = ConductorSettings(load_retention_s=60.0)
    conductors = [
        Conductor(settings, None, records=w)  # type: ignore[arg-type]
        for w in writers
    ]
    for w in writers:
        await w.start()
    try:
        now = time.time()
        for offset in (-300, -200, -100, -30, 0):  # minutes apart: every sample may prune
            activity = KVActivity(bytes_in=300 + offset)
            info = InstanceInfo(
                instance_id="decode-3",
                role=Role.DECODE,
                started_at=now - 900,
                running=offset // -10,
                kv_activity=activity,
            )
            for c, w in zip(conductors, writers):  # both hear it; the second insert is ignored
                c._record_instance(info, now + offset, "ready")
                await w.flush()
        rows = await _rows(engine)
        assert [r.t - now for r in rows] == [pytest.approx(-30, abs=5), pytest.approx(0, abs=5)]
        assert [(r.running, r.bytes_in) for r in rows] == [(3, 70), (0, 30)]
    finally:
        for w in writers:
            await w.close()
        await engine.dispose()


async def test_finished_requests_decisions_and_dead_instances_past_retention_are_pruned(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    conductor = Conductor(
        ConductorSettings(request_retention_s=600.0),
        None,  # type: ignore[arg-type]
        records=writer,
    )
    await writer.start()
    now = time.time()
    try:
        for rid, age, status in [
            ("old", 900, "completed"),
            ("old-running", 900, None),
            ("new", 60, "completed"),
        ]:
            writer.request_accepted(id=rid, model="m", status="queued", arrival_time=now - age)
            writer.decision(request_id=rid, created=now - age, policy="p", candidates=[])
            if status:
                writer.request_finished(rid, status)
        writer.instance_seen(
            id="gone", role="decode", host="h", status="dead", started_at=0.0,
            last_heartbeat=now - 900, info={},
        )  # fmt: skip
        await writer.flush()
        # a heartbeat: its load sample prunes what is past retention
        conductor._record_instance(InstanceInfo(instance_id="d1", role=Role.DECODE), now, "ready")
        await writer.flush()
        async with engine.connect() as conn:
            requests = {r.id for r in await conn.execute(select(RequestRecord))}
            decisions = {r.request_id for r in await conn.execute(select(DecisionRecord))}
            instances = {r.id for r in await conn.execute(select(InstanceRecord))}
        assert requests == {"old-running", "new"}  # a request still running is kept
        assert decisions == {"new"}
        assert instances == {"d1"}
    finally:
        await writer.close()
        await engine.dispose()
