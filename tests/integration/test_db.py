"""Migrations and the record write path on real databases (SQLite; PostgreSQL if given),
the KV pool's replications read back through the console's query."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from sqlalchemy import inspect, select

from console import queries
from shared.db import records
from shared.db import session as db
from shared.db.records import RecordWriter
from shared.db.schema import DecisionRecord, InstanceRecord, ReplicationRecord, RequestRecord
from shared.messages import InstanceInfo, Role


async def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def test_migrations_upgrade_and_downgrade(db_url):
    assert {"requests", "instances"} <= await _tables(db_url)
    await __import__("asyncio").to_thread(db.downgrade, db_url, "base")
    assert not {"requests", "instances"} & await _tables(db_url)
    await db.upgrade_async(db_url)
    assert {"requests", "instances"} <= await _tables(db_url)


async def _row(engine, rid):
    async with db.sessionmaker(engine)() as s:
        return (await s.execute(select(RequestRecord).where(RequestRecord.id == rid))).scalar_one()


async def test_exactly_one_terminal_state(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine)
    await writer.start()
    try:
        now = time.time()
        writer.request_accepted(
            id="r1", model="m", status="queued", arrival_time=now, prompt_tokens=10
        )
        writer.request_update("r1", status="running", prefill_instance="p0")
        writer.request_finished("r1", "completed", completion_tokens=5, finish_time=now + 1)
        # a late second finisher (say, a timeout racing completion) must not overwrite it
        writer.request_finished("r1", "failed", error="late")
        writer.request_update("r1", status="running")
        await writer.flush()
        row = await _row(engine, "r1")
        assert (row.status, row.completion_tokens, row.error, row.prefill_instance) == (
            "completed",
            5,
            None,
            "p0",
        )
        with pytest.raises(ValueError):
            writer.request_finished("r1", "running")
    finally:
        await writer.close()
        await engine.dispose()


async def test_instances_upsert(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine)
    await writer.start()
    try:
        writer.instance_seen(
            id="prefill-0",
            role="prefill",
            host="h",
            status="ready",
            started_at=1.0,
            last_heartbeat=2.0,
            info={"queue_depth": 1},
        )
        writer.instance_seen(id="prefill-0", status="dead")
        await writer.flush()
        async with db.sessionmaker(engine)() as s:
            rows = (await s.execute(select(InstanceRecord))).scalars().all()
        assert [(r.id, r.status, r.info["queue_depth"]) for r in rows] == [("prefill-0", "dead", 1)]
    finally:
        await writer.close()
        await engine.dispose()


async def test_two_conductors_recording_the_same_new_instances_both_succeed(db_url, caplog):
    """A leading conductor and its standby hear the same heartbeats and both record them:
    every write of both lands in its batch, whichever inserts an instance's row first (a
    read-then-insert failed one batch on the primary key, then wrote each alone)."""
    caplog.set_level(logging.WARNING, logger=records.__name__)
    engines = [db.make_engine(db_url) for _ in range(2)]
    writers = [RecordWriter(e, flush_interval_s=0.0) for e in engines]
    for w in writers:
        await w.start()
    try:
        for beat in range(1, 6):
            for n in range(8):  # new ids on the first beat, seen by both at once
                for w in writers:
                    w.instance_seen(
                        id=f"prefill-{n}",
                        role="prefill",
                        host="h",
                        status="ready",
                        started_at=1.0,
                        last_heartbeat=float(beat),
                        info={"beat": beat},
                    )
            await asyncio.gather(*(w.flush() for w in writers))
        assert [w.failures for w in writers] == [0, 0]
        assert [r.getMessage() for r in caplog.records] == []
        async with db.sessionmaker(engines[0])() as s:
            rows = (await s.execute(select(InstanceRecord))).scalars().all()
        assert sorted((r.id, r.last_heartbeat, r.info["beat"]) for r in rows) == [
            (f"prefill-{n}", 5.0, 5) for n in range(8)
        ]
    finally:
        for w in writers:
            await w.close()
        for e in engines:
            await e.dispose()


async def test_a_failed_batch_does_not_kill_the_writer(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine)
    await writer.start()
    try:
        writer.request_accepted(id="dup", model="m", status="queued", arrival_time=1.0)
        await writer.flush()
        writer.request_accepted(id="dup", model="m", status="queued", arrival_time=1.0)
        await writer.flush()
        assert writer.failures == 1
        writer.request_finished("dup", "cancelled")
        await writer.flush()
        assert (await _row(engine, "dup")).status == "cancelled"
    finally:
        await writer.close()
        await engine.dispose()


async def test_one_bad_write_loses_only_itself_and_a_request_placed_twice_keeps_its_last(
    db_url,
):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.2)  # room for one batch to gather
    await writer.start()
    try:
        writer.request_accepted(id="a", model="m", status="queued", arrival_time=1.0)
        await writer.flush()
        decision = dict(created=1.0, policy="kvcentric", candidates=[])
        # one batch: a duplicate insert between two good writes, and the same request placed
        # twice (the decision's last placement wins)
        writer.request_accepted(id="b", model="m", status="queued", arrival_time=2.0)
        writer.request_accepted(id="a", model="m", status="queued", arrival_time=1.0)
        writer.decision(request_id="b", prefill_instance="p0", **decision)
        writer.decision(request_id="b", prefill_instance="p1", **decision)
        writer.request_finished("b", "completed")
        await writer.flush()
        assert writer.failures == 1  # the duplicate, alone
        assert (await _row(engine, "b")).status == "completed"
        async with engine.connect() as conn:
            rows = (await conn.execute(select(DecisionRecord))).all()
        assert [(r.request_id, r.prefill_instance) for r in rows] == [("b", "p1")]
    finally:
        await writer.close()
        await engine.dispose()


def replication(created: float, **changes: Any) -> dict[str, Any]:
    """A replication as the conductor orders it: RecordWriter.replication's arguments."""
    row: dict[str, Any] = {
        "created": created,
        "prefix_hash": 0xFEDC_BA98_7654_3210,  # past 2**63: stored signed, read back unsigned
        "blocks": 12,
        "nbytes": 12 * 3 * 2**20,  # 36 MiB
        "source": "prefill-0",
        "target": "prefill-1",
        "heat_rps": 4.5,
        "holders": 1,
        "reason": "4.5 req/s on 1 holder, over 2.0 req/s each",
    }
    return {**row, **changes}


async def test_migration_0008_adds_and_drops_kv_replications(db_url):
    assert "kv_replications" in await _tables(db_url)
    await asyncio.to_thread(db.downgrade, db_url, "0007")
    tables = await _tables(db_url)
    assert "kv_replications" not in tables and "plan_decisions" in tables
    await db.upgrade_async(db_url)
    assert "kv_replications" in await _tables(db_url)


async def test_a_replication_lands_and_the_console_reads_it_back(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.2)  # room for one batch to gather
    await writer.start()
    try:
        now = time.time()
        small = dict(prefix_hash=0x1234, blocks=2, nbytes=2 * 2**20, holders=2, heat_rps=9.0)
        writer.replication(**replication(now - 30))
        writer.replication(**replication(now - 10, target="prefill-2", **small))
        writer.replication(**replication(now - 7200))  # outside an hour's window
        await writer.flush()
        assert writer.failures == 0
        async with engine.connect() as conn:
            stored = [dict(r._mapping) for r in await conn.execute(select(ReplicationRecord))]
        assert len({r["id"] for r in stored}) == 3  # ids given by the database
        assert {r["prefix_hash"] for r in stored} == {0x1234, 0xFEDC_BA98_7654_3210 - 2**64}
        snap = await asyncio.to_thread(queries.load_snapshot, db_url, 3600.0)
        assert snap.replications is not None
        got = [{k: v for k, v in r.items() if k != "id"} for r in snap.replications]
        assert got == [  # newest first, the hash unsigned again
            replication(now - 10, target="prefill-2", **small),
            replication(now - 30),
        ]
        table = queries.replication_rows(snap.replications)
        assert [(r["prefix"], r["copy"], r["MiB"]) for r in table] == [
            ("0000000000001234", "prefill-0 → prefill-2", 2.0),
            ("fedcba9876543210", "prefill-0 → prefill-1", 36.0),
        ]
        everything = await asyncio.to_thread(queries.load_snapshot, db_url, None)
        assert len(everything.replications or []) == 3
    finally:
        await writer.close()
        await engine.dispose()


async def test_replications_past_retention_are_pruned(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    try:
        now = time.time()
        writer.replication(**replication(now - 900))
        writer.replication(**replication(now - 60))
        await writer.flush()
        info = InstanceInfo(instance_id="d1", role=Role.DECODE)
        writer.load_sample(info, now, 5.0, 3600.0, request_retention_s=600.0)  # prunes
        await writer.flush()
        async with engine.connect() as conn:
            kept = [r.created for r in await conn.execute(select(ReplicationRecord.created))]
        assert writer.failures == 0 and kept == [now - 60]
    finally:
        await writer.close()
        await engine.dispose()
