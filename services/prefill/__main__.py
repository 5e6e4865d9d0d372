"""`python -m services.prefill` / `halfmoon serve prefill`."""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from services.prefill.args import PrefillSettings, parse_args
from services.prefill.handlers import PrefillInstance
from services.worker.bootstrap import load_for, with_instance_id
from services.worker.metrics import EngineMetrics
from services.worker.settings import make_receiver, make_sender
from shared import subjects
from shared.lifecycle import ServiceRuntime, run_main
from shared.transfer import KVSender

log = logging.getLogger("services.prefill")


async def serve(settings: PrefillSettings) -> None:
    settings = with_instance_id(settings, "prefill")
    lm = await load_for(settings, "prefill")
    async with ServiceRuntime(settings, settings.instance_id) as rt:
        nc = await rt.connect()
        sender = make_sender(settings)
        await sender.start()
        rt.stack.push_async_callback(sender.close)
        inst = PrefillInstance(settings, nc, lm, sender, make_receiver(settings))
        inst.kv_port = sender.port
        rt.stack.callback(inst.close_engine)
        await rt.serve_metrics(EngineMetrics(inst).registry)
        submit = await nc.subscribe(
            subjects.prefill_submit(settings.instance_id), cb=inst.on_submit
        )
        await nc.subscribe(subjects.CANCEL, cb=inst.on_cancel)
        await nc.subscribe(subjects.kv_export(settings.instance_id), cb=inst.on_export)
        await nc.subscribe(subjects.prefill_stage(settings.instance_id), cb=inst.stages.on_stage)
        await nc.subscribe(subjects.prefill_hop(settings.instance_id), cb=inst.stages.on_hop)
        await nc.subscribe(
            subjects.prefill_stage_close(settings.instance_id), cb=inst.stages.on_close
        )
        await inst.publish_cleared()  # a previous incarnation's blocks are gone
        rt.spawn(inst.serve(rt.stop))
        rt.heartbeat(inst.heartbeat)
        log.info("prefill %s ready (model %s)", settings.instance_id, lm.name)
        await rt.stopped()
        # Shut down in order: stop intake, finish the prompt in flight, let transfers drain.
        await submit.unsubscribe()
        await rt.join()
        await inst.fail_waiting("prefill instance shut down")
        await inst.publish_cleared()
        await _drain_transfers(sender, settings.transfer_timeout_s)
        log.info("prefill %s stopped", settings.instance_id)


async def _drain_transfers(sender: KVSender, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + min(timeout_s, 10.0)
    while sender.pending and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
