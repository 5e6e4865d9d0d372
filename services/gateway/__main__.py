"""`python -m services.gateway` / `halfmoon serve gateway`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Sequence

from aiohttp import web

from services.gateway.app import make_app, quiet_bad_http_logs
from services.gateway.args import GatewaySettings, parse_args
from services.gateway.auth import Auth
from services.gateway.context import GatewayContext
from services.gateway.prompt import PromptBuilder
from shared import bus, subjects
from shared.db.records import RecordWriter
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
from shared.model_store import ensure_model

log = logging.getLogger("services.gateway")


async def serve(settings: GatewaySettings) -> None:
    instance_id = settings.instance_id or new_instance_id("gateway")
    setup_logging(settings.log_level, "gateway", instance_id)
    quiet_bad_http_logs()
    model_dir = await asyncio.to_thread(ensure_model, settings.model)
    prompts = await asyncio.to_thread(
        PromptBuilder,
        model_dir,
        settings.served_model_name or model_dir.name,
        settings.default_max_tokens,
        max_messages=settings.max_messages,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_output_tokens=settings.max_output_tokens,
    )
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
        gateway = GatewayContext(settings, nc, records, prompts, instance_id)
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=gateway.on_heartbeat)
        auth = Auth.from_settings(settings, engine) if settings.keys_enabled() else None
        log.info("API keys %s", "required on /v1 and /admin" if auth else "off")
        runner = web.AppRunner(
            make_app(gateway, settings.max_body_bytes, auth), shutdown_timeout=15
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)  # stops intake, lets streams finish
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        # /metrics is on the API port; metrics_port (if set) serves it on its own port too.
        await serve_metrics(
            stack, gateway.metrics.registry, settings.metrics_host, settings.metrics_port
        )

        def info() -> InstanceInfo:
            return InstanceInfo(
                instance_id=instance_id,
                role=Role.GATEWAY,
                pid=os.getpid(),
                started_at=started,
                model=prompts.model_name,
                running=gateway.in_flight,
            )

        beat = asyncio.create_task(heartbeat_loop(nc, info, settings.heartbeat_interval_s, stop))
        log.info("gateway %s ready on http://%s:%d", instance_id, settings.host, settings.port)
        await stop.wait()
        await beat
        log.info("gateway %s stopping", instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
