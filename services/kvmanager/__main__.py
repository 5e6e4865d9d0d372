"""`python -m services.kvmanager` / `halfmoon serve kvmanager`."""

from __future__ import annotations

import logging
import os
from typing import Sequence

from services.kvmanager.args import KVManagerSettings, parse_args
from services.kvmanager.handlers import KVManager
from services.kvmanager.metrics import KVManagerMetrics
from services.kvmanager.stream import ensure_stream, replay_and_follow
from shared import subjects
from shared.db.kv_records import KVBlockWriter, load_blocks
from shared.db.session import make_engine
from shared.lifecycle import ServiceRuntime, run_main
from shared.messages import InstanceInfo, Role

log = logging.getLogger("services.kvmanager")


async def serve(settings: KVManagerSettings) -> None:
    async with ServiceRuntime.named(settings, "kvmanager", settings.instance_id) as rt:
        engine = make_engine(settings.database_url)
        rt.stack.push_async_callback(engine.dispose)
        records = KVBlockWriter(engine, settings.metadata_flush_s)
        manager = KVManager(records, settings.hot_rps, settings.heat_half_life_s)
        try:
            manager.restore(await load_blocks(engine))
        except Exception as exc:  # noqa: BLE001 - the stream alone can rebuild the index
            log.warning("cache metadata not loaded from SQL: %s", exc)
        await records.start()
        rt.stack.push_async_callback(records.close)
        await rt.serve_metrics(KVManagerMetrics(manager).registry)
        nc = await rt.connect()
        await ensure_stream(
            nc, settings.stream_max_age_s, settings.stream_max_bytes, settings.stream_replicas
        )
        await replay_and_follow(nc, manager.on_event)
        await nc.subscribe(subjects.KV_MATCH, queue=subjects.KVMANAGER_QUEUE, cb=manager.on_match)

        def info() -> InstanceInfo:
            return InstanceInfo(
                instance_id=rt.instance_id,
                role=Role.KVMANAGER,
                pid=os.getpid(),
                started_at=rt.started,
            )

        rt.heartbeat(info)
        log.info("kvmanager %s ready", rt.instance_id)
        await rt.stopped()
        await rt.join()
        log.info("kvmanager %s stopped", rt.instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
