"""`python -m services.decode` / `halfmoon serve decode`."""

from __future__ import annotations

import logging
from typing import Sequence

from services.decode.args import DecodeSettings, parse_args
from services.decode.handlers import DecodeInstance
from services.worker.bootstrap import load_for, with_instance_id
from services.worker.metrics import EngineMetrics
from services.worker.settings import make_receiver
from shared import subjects
from shared.lifecycle import ServiceRuntime, run_main

log = logging.getLogger("services.decode")


async def serve(settings: DecodeSettings) -> None:
    settings = with_instance_id(settings, "decode")
    lm = await load_for(settings, "decode")
    async with ServiceRuntime(settings, settings.instance_id) as rt:
        nc = await rt.connect()
        inst = DecodeInstance(settings, nc, lm, make_receiver(settings))
        rt.stack.callback(inst.close_engine)
        await rt.serve_metrics(EngineMetrics(inst).registry)
        submit = await nc.subscribe(subjects.decode_submit(settings.instance_id), cb=inst.on_submit)
        stream = await nc.subscribe(subjects.decode_stream(settings.instance_id), cb=inst.on_chunk)
        await nc.subscribe(subjects.CANCEL, cb=inst.on_cancel)
        await inst.publish_cleared()  # a previous incarnation's blocks are gone
        rt.spawn(inst.serve(rt.stop))
        rt.heartbeat(inst.heartbeat)
        log.info("decode %s ready (model %s)", settings.instance_id, lm.name)
        await rt.stopped()
        # Stop intake; sequences still running end with a clear error, never silently.
        await submit.unsubscribe()
        await stream.unsubscribe()
        await rt.join()
        await inst.fail_running("decode instance shut down")
        await inst.publish_cleared()
        log.info("decode %s stopped", settings.instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
