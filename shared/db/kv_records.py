"""Cache metadata writes (kv_blocks), coalesced and flushed in batches off the request path.

Events for the same (block, instance, tier) between two flushes collapse to the last
one, so a busy cluster costs one small transaction per interval, not one per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from sqlalchemy import delete, select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from shared.db.schema import KVBlockRecord
from shared.db.session import sessionmaker
from shared.hashing import from_signed, to_signed

log = logging.getLogger(__name__)
Key = tuple[int, str, str]  # (signed hash, instance, tier)
_BATCH = 500


class KVBlockWriter:
    def __init__(self, engine: AsyncEngine, interval_s: float = 1.0) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine)
        self.interval_s = interval_s
        self._upserts: dict[Key, dict[str, Any]] = {}
        self._deletes: set[Key] = set()
        self._cleared: set[str] = set()
        self._task: asyncio.Task | None = None
        self.failures = 0

    def stored(self, instance: str, tier: str, hashes: list[int], nbytes: int, now: float) -> None:
        for h in hashes:
            key = (to_signed(h), instance, tier)
            self._deletes.discard(key)
            row = self._upserts.get(key)
            if row is None:
                self._upserts[key] = {
                    "nbytes": nbytes,
                    "created": now,
                    "last_access": now,
                    "hits": 0,
                }
            else:
                row["last_access"] = now

    def removed(self, instance: str, tier: str, hashes: list[int]) -> None:
        for h in hashes:
            key = (to_signed(h), instance, tier)
            self._upserts.pop(key, None)
            self._deletes.add(key)

    def cleared(self, instance: str) -> None:
        self._upserts = {k: v for k, v in self._upserts.items() if k[1] != instance}
        self._deletes = {k for k in self._deletes if k[1] != instance}
        self._cleared.add(instance)

    def hit(self, instance: str, tier: str, hashes: list[int], now: float) -> None:
        for h in hashes:
            row = self._upserts.setdefault(
                (to_signed(h), instance, tier),
                {"nbytes": 0, "created": now, "last_access": now, "hits": 0},
            )
            row["hits"] += 1
            row["last_access"] = now

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-block-writer")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        cleared, deletes, upserts = self._cleared, self._deletes, self._upserts
        if not (cleared or deletes or upserts):
            return
        self._cleared, self._deletes, self._upserts = set(), set(), {}
        try:
            async with self._sessions.begin() as session:
                await self._write(session, cleared, deletes, upserts)
        except Exception:
            self.failures += 1
            log.exception(
                "kv_blocks flush failed (%d upserts, %d deletes)", len(upserts), len(deletes)
            )

    async def _write(
        self,
        session: AsyncSession,
        cleared: set[str],
        deletes: set[Key],
        upserts: dict[Key, dict[str, Any]],
    ) -> None:
        t = KVBlockRecord
        for instance in cleared:
            await session.execute(delete(t).where(t.instance_id == instance))
        keys = list(deletes)
        for i in range(0, len(keys), _BATCH):  # bounded statements (SQLite variable limit)
            await session.execute(
                delete(t).where(
                    tuple_(t.block_hash, t.instance_id, t.tier).in_(keys[i : i + _BATCH])
                )
            )
        rows = [
            {
                "block_hash": k[0],
                "instance_id": k[1],
                "tier": k[2],
                "nbytes": v["nbytes"],
                "created": v["created"],
                "last_access": v["last_access"],
                "hit_count": v["hits"],
            }
            for k, v in upserts.items()
        ]
        insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
        for i in range(0, len(rows), _BATCH):
            stmt = insert(t).values(rows[i : i + _BATCH])
            stmt = stmt.on_conflict_do_update(
                index_elements=[t.block_hash, t.instance_id, t.tier],
                set_={
                    "last_access": stmt.excluded.last_access,
                    "hit_count": t.hit_count + stmt.excluded.hit_count,
                },
            )
            await session.execute(stmt)


async def load_blocks(engine: AsyncEngine) -> list[tuple[int, str, str, int, float]]:
    """(unsigned hash, instance, tier, nbytes, last_access) for every known block."""
    async with sessionmaker(engine)() as session:
        rows = (
            await session.execute(
                select(
                    KVBlockRecord.block_hash,
                    KVBlockRecord.instance_id,
                    KVBlockRecord.tier,
                    KVBlockRecord.nbytes,
                    KVBlockRecord.last_access,
                )
            )
        ).all()
    return [(from_signed(h), i, t, n, a) for h, i, t, n, a in rows]
