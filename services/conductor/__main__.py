"""`python -m services.conductor` / `halfmoon serve conductor`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Sequence

from shared import bus, subjects
from shared.db.records import RecordWriter
from shared.db.session import make_engine
from shared.lifecycle import (heartbeat_loop, install_stop_signals, new_instance_id, run_main,
                              setup_logging)
from shared.messages import InstanceInfo, Role
from services.conductor.args import ConductorSettings, parse_args
from services.conductor.handlers import Conductor

log = logging.getLogger("services.conductor")


async def _sweep(conductor: Conductor, stop: asyncio.Event, interval_s: float) -> None:
    while not stop.is_set():
        conductor.sweep()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def serve(settings: ConductorSettings) -> None:
    instance_id = settings.instance_id or new_instance_id("conductor")
    setup_logging(settings.log_level, "conductor", instance_id)
    stop = asyncio.Event()
    install_stop_signals(stop)
    started = time.time()
    async with contextlib.AsyncExitStack() as stack:
        engine = make_engine(settings.database_url)
        stack.push_async_callback(engine.dispose)
        records = RecordWriter(engine)
        await records.start()
        stack.push_async_callback(records.close)
        nc = await bus.connect(settings, instance_id)
        stack.push_async_callback(bus.close, nc)
        conductor = Conductor(settings, nc, records)
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=conductor.on_heartbeat)
        await nc.subscribe(subjects.CONDUCTOR_SCHEDULE, queue=subjects.CONDUCTOR_QUEUE,
                           cb=conductor.on_schedule)
        info = lambda: InstanceInfo(instance_id=instance_id, role=Role.CONDUCTOR,  # noqa: E731
                                    pid=os.getpid(), started_at=started)
        tasks = [asyncio.create_task(heartbeat_loop(nc, info, settings.heartbeat_interval_s, stop)),
                 asyncio.create_task(_sweep(conductor, stop, settings.heartbeat_expiry_s / 3))]
        log.info("conductor %s ready (policy %s)", instance_id, settings.policy)
        await stop.wait()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("conductor %s stopped", instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
