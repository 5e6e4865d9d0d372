"""Load samples through the real write path: heartbeats on a real nats-server, the
conductor's heartbeat handler, the RecordWriter, real SQL (SQLite; PostgreSQL if given),
read back by the console's queries."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from sqlalchemy import select

from console import history, queries
from services.conductor.args import ConductorSettings
from services.conductor.handlers import Conductor
from shared import subjects
from shared.db import session as db
from shared.db.records import RecordWriter
from shared.db.schema import LoadSample
from shared.messages import InstanceInfo, KVActivity, Role


async def _rows(engine) -> list[LoadSample]:
    async with db.sessionmaker(engine)() as s:
        return list((await s.execute(select(LoadSample).order_by(LoadSample.t))).scalars())


async def test_heartbeats_become_load_samples(nats_url, db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    nc = await nats.connect(nats_url)
    interval = 0.5
    conductor = Conductor(ConductorSettings(nats_url=nats_url, instance_record_interval_s=interval),
                          nc, records=writer)
    sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=conductor.on_heartbeat)
    try:
        started = time.time()
        for k in range(1, 9):  # ~4 intervals of heartbeats, every quarter interval
            info = InstanceInfo(instance_id="prefill-7", role=Role.PREFILL, started_at=started,
                                queue_depth=k, running=1, kv_blocks_total=64, kv_blocks_free=60,
                                kv_activity=KVActivity(transfers_out=k, bytes_out=1000 * k),
                                sent_at=time.time())
            await nc.publish(subjects.heartbeat("prefill", "prefill-7"), info.encode())
            gateway = InstanceInfo(instance_id="gw", role=Role.GATEWAY, sent_at=time.time())
            await nc.publish(subjects.heartbeat("gateway", "gw"), gateway.encode())
            await nc.flush()
            await asyncio.sleep(interval / 4)
        await asyncio.sleep(0.2)  # the last heartbeats' callbacks
        await writer.flush()
        rows = await _rows(engine)
        assert {r.instance_id for r in rows} == {"prefill-7"}  # no samples of the gateway
        assert 2 <= len(rows) <= 5, [(r.t, r.transfers_out) for r in rows]
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
    conductors = [Conductor(settings, None, records=w)  # type: ignore[arg-type]
                  for w in writers]
    for w in writers:
        await w.start()
    try:
        now = time.time()
        for offset in (-300, -200, -100, -30, 0):  # minutes apart: every sample may prune
            activity = KVActivity(bytes_in=300 + offset)
            info = InstanceInfo(instance_id="decode-3", role=Role.DECODE, started_at=now - 900,
                                running=offset // -10, kv_activity=activity)
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
