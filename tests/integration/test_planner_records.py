"""The P/D planner's SQL record on real databases (SQLite; PostgreSQL if given): migration
0006, plan decisions and role switches through the RecordWriter, and their pruning."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from sqlalchemy import inspect, select

from console import queries
from services.conductor import orphans
from services.conductor.args import ConductorSettings
from services.conductor.registry import Registry
from services.conductor.roles import Pending
from shared.db import session as db
from shared.db.records import RecordWriter
from shared.db.schema import PlanDecisionRecord, RoleSwitchRecord
from shared.messages import InstanceInfo, Role

TABLES = {"plan_decisions", "role_switches"}


def plan(created: float, **changes: Any) -> dict[str, Any]:
    """A row as planner.decision_record writes it: one advisory switch, weighed."""
    row: dict[str, Any] = {
        "created": created,
        "mode": "advisory",
        "current_prefill": 2,
        "current_decode": 1,
        "best_prefill": 1,
        "best_decode": 2,
        "switch_instance": "prefill-1",
        "switch_from": "prefill",
        "switch_to": "decode",
        "drain_s": 0.8,
        "acted": False,
        "reason": "decode overloaded: TBT 0.2 s > SLO 0.1 s",
        "attainment": 0.75,
        "forecast": {"rate_per_s": 3.5, "prompt_tokens": 900.0, "output_tokens": 120.0},
        "instances": [{"instance_id": "prefill-1", "role": "prefill", "queue_s": 0.1}],
        "estimates": [
            {"prefill": 2, "decode": 1, "goodput_rps": 1.5, "ttft_s": 0.3, "tbt_s": None},
            {"prefill": 1, "decode": 2, "goodput_rps": 3.2, "ttft_s": 0.6, "tbt_s": 0.05},
        ],
    }
    return {**row, **changes}


def switch(switch_id: str, requested_at: float, status: str, **changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": switch_id,
        "instance_id": "prefill-1",
        "from_role": "prefill",
        "to_role": "decode",
        "source": "planner",
        "status": status,
        "requested_at": requested_at,
        "finished_at": None,
        "drain_s": None,
        "detail": None,
    }
    return {**row, **changes}


async def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def _rows(engine, table) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return [dict(r._mapping) for r in await conn.execute(select(table.__table__))]


async def test_migration_0006_adds_and_drops_the_tables(db_url):
    assert TABLES <= await _tables(db_url)
    await asyncio.to_thread(db.downgrade, db_url, "0005")
    assert not TABLES & await _tables(db_url) and "api_keys" in await _tables(db_url)
    await db.upgrade_async(db_url)
    assert TABLES <= await _tables(db_url)


async def test_a_plan_decision_lands_with_every_field(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    try:
        now = time.time()
        writer.plan_decision(**plan(now))
        # inf in a JSON column (PostgreSQL's JSON refuses it) is stored as null
        writer.plan_decision(**plan(now + 5, acted=True, forecast={"rate_per_s": float("inf")}))
        writer.plan_decision(**plan(now + 10, switch_instance=None, switch_from=None,
                                    switch_to=None, drain_s=None, attainment=None))  # fmt: skip
        await writer.flush()
        rows = sorted(await _rows(engine, PlanDecisionRecord), key=lambda r: r["created"])
        assert writer.failures == 0 and len(rows) == 3
        assert len({r["id"] for r in rows}) == 3  # ids given by the database
        first = {k: v for k, v in rows[0].items() if k != "id"}
        assert first == plan(now)
        assert rows[1]["acted"] is True and rows[1]["forecast"] == {"rate_per_s": None}
        assert (rows[2]["switch_instance"], rows[2]["attainment"]) == (None, None)
        # and the console reads them back (on this backend too)
        data = await asyncio.to_thread(queries.load_planner, db_url, None)
        assert [r["created"] for r in data.splits] == [now, now + 5, now + 10]
        assert [r["created"] for r in data.notable] == [now + 10, now + 5, now]  # 2:1, best 1:2
        assert data.latest is not None and data.latest["estimates"] == plan(now)["estimates"]
    finally:
        await writer.close()
        await engine.dispose()


async def test_a_role_switch_is_upserted_by_its_id(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.2)  # room for one batch to gather
    await writer.start()
    try:
        now = time.time()
        done = {"finished_at": now + 2.5, "drain_s": 2.4, "detail": "3 sequences finished"}
        writer.role_switch(**switch("s1", now, "draining"))
        await writer.flush()
        assert [r["status"] for r in await _rows(engine, RoleSwitchRecord)] == ["draining"]
        writer.role_switch(**switch("s1", now, "done", **done))
        # one batch: a switch drained and ended; only what changed on the second write
        writer.role_switch(**switch("s2", now + 1, "draining", source="admin"))
        writer.role_switch(id="s2", status="failed", finished_at=now + 9, detail="timed out")
        writer.role_switch(**switch("s3", now + 2, "refused", from_role="", detail="last one"))
        await writer.flush()
        writer.role_switch(**switch("s1", now, "draining"))  # late: must not undo "done"
        await writer.flush()
        rows = {r["id"]: r for r in await _rows(engine, RoleSwitchRecord)}
        assert writer.failures == 0
        assert rows["s1"] == switch("s1", now, "done", **done)
        assert (rows["s2"]["status"], rows["s2"]["source"], rows["s2"]["detail"]) == (
            "failed",
            "admin",
            "timed out",
        )
        assert (rows["s2"]["finished_at"], rows["s2"]["instance_id"]) == (now + 9, "prefill-1")
        assert (rows["s3"]["status"], rows["s3"]["from_role"]) == ("refused", "")
    finally:
        await writer.close()
        await engine.dispose()


async def test_planner_rows_past_retention_are_pruned_but_a_draining_switch_is_kept(db_url):
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    try:
        now = time.time()
        writer.plan_decision(**plan(now - 900))
        writer.plan_decision(**plan(now - 60))
        writer.role_switch(**switch("old-done", now - 900, "done"))
        writer.role_switch(**switch("old-draining", now - 900, "draining"))
        writer.role_switch(**switch("new", now - 60, "refused"))
        await writer.flush()
        info = InstanceInfo(instance_id="d1", role=Role.DECODE)
        writer.load_sample(info, now, 5.0, 3600.0, request_retention_s=600.0)  # prunes
        await writer.flush()
        decisions = [r["created"] for r in await _rows(engine, PlanDecisionRecord)]
        switches = {r["id"] for r in await _rows(engine, RoleSwitchRecord)}
        assert decisions == [now - 60]
        assert switches == {"old-draining", "new"}
    finally:
        await writer.close()
        await engine.dispose()


async def test_switches_left_draining_by_a_stopped_conductor_are_settled_by_the_leader(db_url):
    """A conductor killed mid-switch leaves its row "draining"; the leader settles it from
    the heartbeats: done once the instance is ready in its new role, failed once it is gone
    past the give-up time, and a switch the leader runs itself is left to it."""
    engine = db.make_engine(db_url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    settings = ConductorSettings()
    registry = Registry(settings.heartbeat_expiry_s)
    leading = [False]
    mine = Pending("mine", 0.0, asyncio.get_running_loop().create_future())
    conductor = SimpleNamespace(
        records=writer,
        settings=settings,
        registry=registry,
        leading=lambda: leading[0],
        roles=SimpleNamespace(pending={"prefill-3": mine}),
    )
    try:
        now = time.time()
        late = orphans.give_up_s(settings.switch_drain_timeout_s, settings.heartbeat_expiry_s)
        writer.role_switch(**switch("switched", now - 5, "draining", instance_id="prefill-1"))
        writer.role_switch(**switch("gone", now - late - 1, "draining", instance_id="prefill-2"))
        writer.role_switch(**switch("mine", now - late - 1, "draining", instance_id="prefill-3"))
        writer.role_switch(**switch("running", now - 5, "draining", instance_id="prefill-4"))
        await writer.flush()
        registry.seen(InstanceInfo(instance_id="prefill-1", role=Role.DECODE), now)
        registry.seen(
            InstanceInfo(instance_id="prefill-4", role=Role.PREFILL, status="switching"), now
        )
        assert await orphans.settle(conductor) == 0  # a standby writes nothing
        leading[0] = True
        assert await orphans.settle(conductor) == 2
        await writer.flush()
        rows = {r["id"]: r for r in await _rows(engine, RoleSwitchRecord)}
        assert {k: r["status"] for k, r in rows.items()} == {
            "switched": "done",
            "gone": "failed",
            "mine": "draining",
            "running": "draining",
        }
        assert "no conductor waited" in rows["switched"]["detail"]
        assert "stopped before" in rows["gone"]["detail"]
        assert rows["switched"]["finished_at"] >= now and rows["switched"]["from_role"] == "prefill"
    finally:
        await writer.close()
        await engine.dispose()
