"""`python -m services.decode` / `halfmoon serve decode`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Sequence

from services.decode.args import DecodeSettings, parse_args
from services.decode.handlers import DecodeInstance
from services.worker.bootstrap import load_for, with_instance_id
from services.worker.metrics import EngineMetrics
from services.worker.settings import make_receiver
from shared import bus, subjects
from shared.lifecycle import heartbeat_loop, install_stop_signals, run_main
from shared.metrics import serve_metrics

log = logging.getLogger("services.decode")


async def serve(settings: DecodeSettings) -> None:
    settings = with_instance_id(settings, "decode")
    lm = await load_for(settings, "decode")
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(settings, settings.instance_id)
        stack.push_async_callback(bus.close, nc)
        inst = DecodeInstance(settings, nc, lm, make_receiver(settings))
        stack.callback(inst.close_engine)
        await serve_metrics(
            stack, EngineMetrics(inst).registry, settings.metrics_host, settings.metrics_port
        )
        submit = await nc.subscribe(subjects.decode_submit(settings.instance_id), cb=inst.on_submit)
        stream = await nc.subscribe(subjects.decode_stream(settings.instance_id), cb=inst.on_chunk)
        await nc.subscribe(subjects.CANCEL, cb=inst.on_cancel)
        await inst.publish_cleared()  # a previous incarnation's blocks are gone
        worker = asyncio.create_task(inst.serve(stop))
        beat = asyncio.create_task(
            heartbeat_loop(nc, inst.heartbeat, settings.heartbeat_interval_s, stop)
        )
        log.info("decode %s ready (model %s)", settings.instance_id, lm.name)
        await stop.wait()
        # Stop intake; sequences still running end with a clear error, never silently.
        await submit.unsubscribe()
        await stream.unsubscribe()
        await asyncio.gather(worker, beat, return_exceptions=True)
        await inst.fail_running("decode instance shut down")
        await inst.publish_cleared()
        log.info("decode %s stopped", settings.instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
