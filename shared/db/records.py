"""Write paths: request records, instance rows, load samples, the P/D planner's decisions
and role switches, and the KV pool's hot-prefix replications, batched and off the request
path.

Callers enqueue plain dict updates; one task writes them in small transactions. A
request row is inserted once and then only updated, and a terminal status is written
only over a non-terminal one, so every request ends in exactly one terminal state even
if two parties race to finish it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import delete, insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from shared.db.load_samples import LoadSampler
from shared.db.schema import (
    TERMINAL_STATUSES,
    DecisionRecord,
    InstanceRecord,
    LoadSample,
    PlanDecisionRecord,
    ReplicationRecord,
    RequestRecord,
    RoleSwitchRecord,
)
from shared.db.session import sessionmaker
from shared.hashing import to_signed
from shared.messages import InstanceInfo

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 60.0  # old load samples are deleted at most this often


@dataclass
class _Op:
    # insert | update | terminal | instance | decision | load | prune | plan | switch | replication
    kind: str
    values: dict[str, Any]
    done: asyncio.Future | None = field(default=None)


class RecordWriter:
    """Batches SQL writes in one background task."""

    def __init__(self, engine: AsyncEngine, batch_size: int = 128, flush_interval_s: float = 0.05):
        self.engine = engine
        self._sessions = sessionmaker(engine)
        self._queue: asyncio.Queue[_Op] = asyncio.Queue()
        self._batch_size = batch_size
        self._interval = flush_interval_s
        self._task: asyncio.Task | None = None
        self.failures = 0
        self._sampler = LoadSampler()
        self._pruned_at = float("-inf")

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="record-writer")

    async def close(self) -> None:
        """Flush what is queued, then stop."""
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def flush(self) -> None:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Op("barrier", {}, fut))
        await fut

    # -- request records ------------------------------------------------------------
    def request_accepted(self, **values: Any) -> None:
        self._queue.put_nowait(_Op("insert", values))

    def request_update(self, request_id: str, **values: Any) -> None:
        self._queue.put_nowait(_Op("update", {"id": request_id, **values}))

    def request_finished(self, request_id: str, status: str, **values: Any) -> None:
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"{status!r} is not a terminal status")
        self._queue.put_nowait(_Op("terminal", {"id": request_id, "status": status, **values}))

    def decision(self, **values: Any) -> None:
        self._queue.put_nowait(_Op("decision", values))

    # -- instances ------------------------------------------------------------------
    def instance_seen(self, **values: Any) -> None:
        self._queue.put_nowait(_Op("instance", values))

    # -- the P/D planner ----------------------------------------------------------------
    def plan_decision(self, **values: Any) -> None:
        """One PlanDecisionRecord row (planner.decision_record's dict), inserted."""
        self._queue.put_nowait(_Op("plan", values))

    def role_switch(self, **values: Any) -> None:
        """A RoleSwitchRecord by its id: the first write carries every column (status
        "draining", or "refused"); later ones may carry only what changed (status,
        finished_at, drain_s, detail)."""
        self._queue.put_nowait(_Op("switch", values))

    # -- the KV pool --------------------------------------------------------------------
    def replication(
        self,
        created: float,
        prefix_hash: int,
        blocks: int,
        nbytes: int,
        source: str,
        target: str,
        heat_rps: float,
        holders: int,
        reason: str,
    ) -> None:
        """One hot-prefix replication the conductor ordered (a ReplicationRecord row),
        inserted: `prefix_hash` (the copied prefix's last block) is stored as kv_blocks
        stores block hashes, in BIGINT's signed range (shared.hashing.to_signed)."""
        values = {
            "created": created,
            "prefix_hash": to_signed(prefix_hash),
            "blocks": blocks,
            "nbytes": nbytes,
            "source": source,
            "target": target,
            "heat_rps": heat_rps,
            "holders": holders,
            "reason": reason,
        }
        self._queue.put_nowait(_Op("replication", values))

    # -- load samples ---------------------------------------------------------------
    def load_sample(
        self,
        info: InstanceInfo,
        now: float,
        interval_s: float,
        retention_s: float,
        request_retention_s: float = 0.0,
    ) -> None:
        """Call on every heartbeat: one row per instance per interval is kept, and rows
        older than retention_s are deleted now and then so the table stays bounded; so
        are finished requests, their decisions, dead instances' rows, plan decisions,
        finished role switches and replications older than request_retention_s (0: kept
        for ever)."""
        row = self._sampler.sample(info, now, interval_s)
        if row is None:
            return
        self._queue.put_nowait(_Op("load", row))
        if now - self._pruned_at >= min(PRUNE_EVERY_S, retention_s):
            self._pruned_at = now
            requests_before = now - request_retention_s if request_retention_s > 0 else None
            self._queue.put_nowait(
                _Op("prune", {"before": now - retention_s, "requests_before": requests_before})
            )

    async def _run(self) -> None:
        while True:
            ops = [await self._queue.get()]
            await asyncio.sleep(self._interval)  # let a batch gather
            while len(ops) < self._batch_size and not self._queue.empty():
                ops.append(self._queue.get_nowait())
            await self._write(ops)

    async def _write(self, ops: list[_Op]) -> None:
        try:
            await self._commit(ops)
        except Exception as exc:  # noqa: BLE001 - any driver error: retried one by one
            # One bad write (a duplicate id, a value the column refuses) must not take the
            # batch's others with it: each alone, so only what fails is lost, and named.
            log.warning("SQL batch of %d writes failed (%s); writing each alone", len(ops), exc)
            for op in ops:
                try:
                    await self._commit([op])
                except Exception as one:  # noqa: BLE001 - counted and logged, never raised
                    self.failures += 1
                    log.error("SQL %s write of %s lost: %s", op.kind, _key(op), _brief(one))
        finally:
            for op in ops:
                if op.done is not None and not op.done.done():
                    op.done.set_result(None)

    async def _commit(self, ops: list[_Op]) -> None:
        async with self._sessions.begin() as session:
            for op in ops:
                await self._apply(session, op)

    async def _apply(self, session: AsyncSession, op: _Op) -> None:
        t = RequestRecord
        if op.kind == "insert":
            await session.execute(insert(t).values(**op.values))
        elif op.kind == "update":
            values = dict(op.values)
            rid = values.pop("id")
            await session.execute(
                update(t)
                .where(t.id == rid, t.status.not_in(list(TERMINAL_STATUSES)))
                .values(**values)
            )
        elif op.kind == "terminal":
            values = dict(op.values)
            rid = values.pop("id")
            # An UPDATE's result is a cursor's: it has the row count.
            result = cast(
                CursorResult[Any],
                await session.execute(
                    update(t)
                    .where(t.id == rid, t.status.not_in(list(TERMINAL_STATUSES)))
                    .values(**values)
                ),
            )
            if result.rowcount == 0:
                log.warning(
                    "request %s already had a terminal status; %s ignored", rid, values["status"]
                )
        elif op.kind == "instance":
            await _upsert_instance(session, op.values)
        elif op.kind == "decision":
            # The same request placed again (asked twice, or after a conductor failover):
            # the last placement is where it went.
            values = {k: v for k, v in op.values.items() if k != "request_id"}
            await session.execute(
                _insert(session, DecisionRecord)
                .values(**op.values)
                .on_conflict_do_update(index_elements=["request_id"], set_=values)
            )
        elif op.kind == "load":
            # Another conductor may have sampled the same interval: keep the first row.
            await session.execute(
                _insert(session, LoadSample).values(**op.values).on_conflict_do_nothing()
            )
        elif op.kind == "plan":
            await session.execute(insert(PlanDecisionRecord).values(**_finite_json(op.values)))
        elif op.kind == "switch":
            await _upsert_switch(session, op.values)
        elif op.kind == "replication":
            await session.execute(insert(ReplicationRecord).values(**op.values))
        elif op.kind == "prune":
            await session.execute(delete(LoadSample).where(LoadSample.t < op.values["before"]))
            before = op.values.get("requests_before")
            if before is not None:
                await _prune_records(session, before)


async def _prune_records(session: AsyncSession, before: float) -> None:
    """Finished requests that arrived before `before`, decisions made before it, rows of
    instances dead since before it, plan decisions, finished role switches and replications.
    A request still running, or a switch still draining, is kept however old."""
    r, d, i = RequestRecord, DecisionRecord, InstanceRecord
    p, s, k = PlanDecisionRecord, RoleSwitchRecord, ReplicationRecord
    await session.execute(
        delete(r).where(r.arrival_time < before, r.status.in_(list(TERMINAL_STATUSES)))
    )
    await session.execute(delete(d).where(d.created < before))
    await session.execute(delete(i).where(i.status == "dead", i.last_heartbeat < before))
    await session.execute(delete(p).where(p.created < before))
    await session.execute(delete(s).where(s.requested_at < before, s.status != "draining"))
    await session.execute(delete(k).where(k.created < before))


def _insert(session: AsyncSession, table: Any) -> Any:
    """INSERT with ON CONFLICT, in the session's dialect (PostgreSQL or SQLite)."""
    dialect = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    return dialect(table)


def _key(op: _Op) -> str:
    v = op.values
    if op.kind == "replication":
        return f"{v.get('source')} -> {v.get('target')}"[:80]
    return str(v.get("id") or v.get("request_id") or v.get("instance_id") or "-")[:80]


def _brief(exc: Exception) -> str:
    """The driver's own message, without SQLAlchemy's statement and parameters."""
    return str(getattr(exc, "orig", None) or exc).splitlines()[0][:300]


# The columns an instance's first write must carry: a write without them is an update.
_REQUIRED_INSTANCE_COLUMNS = frozenset(
    c.name for c in InstanceRecord.__table__.columns if not c.nullable and c.default is None
)


async def _upsert_instance(session: AsyncSession, values: dict[str, Any]) -> None:
    # One statement, not a read then an insert: two conductors (a leader and its standby)
    # both record every instance they hear, and a read-then-insert let both insert the same
    # new id, one of them failing on the primary key.
    # A row's first write carries every column; a later one may carry only what changed
    # (a death), which is an UPDATE: an INSERT of it would break NOT NULL, conflict or not.
    changed = {k: v for k, v in values.items() if k != "id"}
    if not _REQUIRED_INSTANCE_COLUMNS <= values.keys():
        t = InstanceRecord
        await session.execute(update(t).where(t.id == values["id"]).values(**changed))
        return
    await session.execute(
        _insert(session, InstanceRecord)
        .values(**values)
        .on_conflict_do_update(index_elements=["id"], set_=changed)
    )


async def _upsert_switch(session: AsyncSession, values: dict[str, Any]) -> None:
    # A read, then an insert or an update: a switch's row is first written by the one
    # conductor that runs it, then two or three times more by it or by the leader settling
    # it (orphans.py). A late "draining" (a retried first write) must not undo how the
    # switch ended.
    existing = await session.get(RoleSwitchRecord, values["id"])
    if existing is None:
        session.add(RoleSwitchRecord(**values))
    elif existing.status == "draining" or values.get("status") != "draining":
        for key, value in values.items():
            setattr(existing, key, value)


_JSON_COLUMNS = ("forecast", "instances", "estimates")


def _finite_json(values: dict[str, Any]) -> dict[str, Any]:
    """The JSON columns with every non-finite float as None: PostgreSQL's JSON refuses
    Infinity and NaN (SQLite keeps them, as text that is not JSON). decision_record already
    does this; a caller that forgets must not lose the row on PostgreSQL alone."""
    return {k: _finite(v) if k in _JSON_COLUMNS else v for k, v in values.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
