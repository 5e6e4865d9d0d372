"""Cache metadata in SQL: coalesced writes, and the KV manager's restore from them."""

from __future__ import annotations

from sqlalchemy import select

from services.kvmanager.handlers import KVManager
from shared.db import session as db
from shared.db.kv_records import KVBlockWriter, load_blocks
from shared.db.schema import KVBlockRecord
from shared.hashing import to_signed
from shared.messages import KVEvent, KVEventKind

BIG = (1 << 64) - 5  # an unsigned hash above BIGINT's range: stored signed, read back unsigned


async def rows(engine):
    async with db.sessionmaker(engine)() as s:
        return sorted(
            (r.block_hash, r.instance_id, r.tier, r.hit_count)
            for r in (await s.execute(select(KVBlockRecord))).scalars()
        )


async def test_writes_coalesce_and_round_trip(db_url):
    engine = db.make_engine(db_url)
    writer = KVBlockWriter(engine)
    try:
        writer.stored("p0", "dram", [1, 2, BIG], 100, now=1.0)
        writer.stored("p1", "dram", [1], 100, now=1.0)
        writer.removed("p0", "dram", [2])
        writer.hit("p0", "dram", [1], now=2.0)
        await writer.flush()
        assert await rows(engine) == sorted(
            [(1, "p0", "dram", 1), (to_signed(BIG), "p0", "dram", 0), (1, "p1", "dram", 0)]
        )
        writer.hit("p0", "dram", [1], now=3.0)
        writer.cleared("p1")
        await writer.flush()
        assert await rows(engine) == sorted(
            [(1, "p0", "dram", 2), (to_signed(BIG), "p0", "dram", 0)]
        )
        loaded = await load_blocks(engine)
        assert {(h, i) for h, i, *_ in loaded} == {(1, "p0"), (BIG, "p0")}
        manager = KVManager()
        manager.restore(loaded)
        assert manager.index.best_prefix([1]) == ("p0", 1)
        assert writer.failures == 0
    finally:
        await engine.dispose()


async def test_manager_events_reach_sql(db_url):
    engine = db.make_engine(db_url)
    writer = KVBlockWriter(engine)
    manager = KVManager(writer)
    try:
        for kind, hashes in ((KVEventKind.STORED, [5, 6, 7]), (KVEventKind.REMOVED, [7])):
            manager.apply(
                KVEvent(kind=kind, instance_id="d0", block_hashes=hashes, block_nbytes=8), now=1.0
            )
        await writer.flush()
        assert [r[0] for r in await rows(engine)] == [5, 6]
    finally:
        await engine.dispose()
