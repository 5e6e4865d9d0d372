"""`halfmoon serve prefill` / `halfmoon serve decode`: one engine process, in the role it
starts in, ready to switch to the other in place (roles.py)."""

from __future__ import annotations

import logging

from services.worker.bootstrap import load_for, with_instance_id
from services.worker.roles import EngineSettings, RoleHost
from services.worker.settings import make_receiver, make_sender
from shared import subjects
from shared.lifecycle import ServiceRuntime

log = logging.getLogger("services.worker")


async def serve(settings: EngineSettings) -> None:
    settings = with_instance_id(settings, settings.role)
    lm = await load_for(settings, settings.role)
    async with ServiceRuntime(settings, settings.instance_id) as rt:
        nc = await rt.connect()
        sender = make_sender(settings)
        await sender.start()
        rt.stack.push_async_callback(sender.close)
        host = RoleHost(settings, rt, nc, lm, sender, make_receiver(settings))
        rt.stack.callback(host.close)
        await host.start(settings.role)
        assert host.metrics is not None
        await rt.serve_metrics(host.metrics.registry)
        await nc.subscribe(subjects.instance_role(settings.instance_id), cb=host.on_switch)
        rt.heartbeat(host.heartbeat)
        log.info("%s %s ready (model %s)", settings.role, settings.instance_id, lm.name)
        await rt.stopped()
        await rt.join()
        await host.shutdown()
        log.info("%s %s stopped", host.inst.role.value, settings.instance_id)
