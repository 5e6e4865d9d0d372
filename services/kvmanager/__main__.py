"""`python -m services.kvmanager` / `halfmoon serve kvmanager`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Sequence

from services.kvmanager.args import KVManagerSettings, parse_args
from services.kvmanager.handlers import KVManager
from services.kvmanager.metrics import KVManagerMetrics
from services.kvmanager.stream import ensure_stream, replay_and_follow
from shared import bus, subjects
from shared.db.kv_records import KVBlockWriter, load_blocks
from shared.db.session import make_engine
from shared.lifecycle import (
    heartbeat_loop,
    install_stop_signals,
    new_instance_id,
    run_main,
    setup_logging,
)
from shared.messages import InstanceInfo, Role
from shared.metrics import serve_metrics

log = logging.getLogger("services.kvmanager")


async def serve(settings: KVManagerSettings) -> None:
    instance_id = settings.instance_id or new_instance_id("kvmanager")
    setup_logging(settings.log_level, "kvmanager", instance_id)
    stop = asyncio.Event()
    install_stop_signals(stop)
    started = time.time()
    async with contextlib.AsyncExitStack() as stack:
        engine = make_engine(settings.database_url)
        stack.push_async_callback(engine.dispose)
        records = KVBlockWriter(engine, settings.metadata_flush_s)
        manager = KVManager(records)
        try:
            manager.restore(await load_blocks(engine))
        except Exception as exc:  # noqa: BLE001 - the stream alone can rebuild the index
            log.warning("cache metadata not loaded from SQL: %s", exc)
        await records.start()
        stack.push_async_callback(records.close)
        await serve_metrics(
            stack, KVManagerMetrics(manager).registry, settings.metrics_host, settings.metrics_port
        )
        nc = await bus.connect(settings, instance_id)
        stack.push_async_callback(bus.close, nc)
        await ensure_stream(nc, settings.stream_max_age_s, settings.stream_max_bytes)
        await replay_and_follow(nc, manager.on_event)
        await nc.subscribe(subjects.KV_MATCH, queue=subjects.KVMANAGER_QUEUE, cb=manager.on_match)

        def info() -> InstanceInfo:
            return InstanceInfo(
                instance_id=instance_id, role=Role.KVMANAGER, pid=os.getpid(), started_at=started
            )

        beat = asyncio.create_task(heartbeat_loop(nc, info, settings.heartbeat_interval_s, stop))
        log.info("kvmanager %s ready", instance_id)
        await stop.wait()
        await beat
        log.info("kvmanager %s stopped", instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
