"""`python -m services.gateway` / `halfmoon serve gateway`."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Sequence

from aiohttp import web

from services.gateway.app import make_app, quiet_bad_http_logs
from services.gateway.args import GatewaySettings, parse_args
from services.gateway.auth import Auth
from services.gateway.context import GatewayContext
from services.gateway.prompt import PromptBuilder
from shared import subjects
from shared.db.records import RecordWriter
from shared.db.session import make_engine
from shared.lifecycle import ServiceRuntime, run_main
from shared.messages import InstanceInfo, Role
from shared.model_context import for_model
from shared.model_store import ensure_model

log = logging.getLogger("services.gateway")


async def load_prompts(settings: GatewaySettings) -> PromptBuilder:
    """The tokenizer and chat template (off the event loop: it reads the model folder)."""
    model_dir = await asyncio.to_thread(ensure_model, settings.model)
    try:
        context = for_model(model_dir, settings.max_model_len, settings.rope_scaling)
    except ValueError as exc:
        raise SystemExit(f"gateway: {exc}") from None  # a setting at fault: one line
    return await asyncio.to_thread(
        PromptBuilder,
        model_dir,
        settings.served_model_name or model_dir.name,
        settings.default_max_tokens,
        max_model_len=context.max_model_len,
        max_messages=settings.max_messages,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_output_tokens=settings.max_output_tokens,
        tool_format=settings.tool_format,
    )


async def serve(settings: GatewaySettings) -> None:
    runtime = ServiceRuntime.named(settings, "gateway", settings.instance_id)
    quiet_bad_http_logs()
    prompts = await load_prompts(settings)
    async with runtime as rt:
        engine = make_engine(settings.database_url)
        rt.stack.push_async_callback(engine.dispose)
        records = RecordWriter(engine)
        await records.start()
        rt.stack.push_async_callback(records.close)
        nc = await rt.connect()
        gateway = GatewayContext(settings, nc, records, prompts, rt.instance_id)
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=gateway.on_heartbeat)
        auth = Auth.from_settings(settings, engine) if settings.keys_enabled() else None
        log.info("API keys %s", "required on /v1 and /admin" if auth else "off")
        runner = web.AppRunner(
            make_app(gateway, settings.max_body_bytes, auth), shutdown_timeout=15
        )
        await runner.setup()
        rt.stack.push_async_callback(runner.cleanup)  # stops intake, lets streams finish
        await web.TCPSite(runner, settings.host, settings.port).start()
        # /metrics is on the API port; metrics_port (if set) serves it on its own port too.
        await rt.serve_metrics(gateway.metrics.registry)

        def info() -> InstanceInfo:
            return InstanceInfo(
                instance_id=rt.instance_id,
                role=Role.GATEWAY,
                pid=os.getpid(),
                started_at=rt.started,
                model=prompts.model_name,
                running=gateway.in_flight,
            )

        rt.heartbeat(info)
        log.info("gateway %s ready on http://%s:%d", rt.instance_id, settings.host, settings.port)
        await rt.stopped()
        await rt.join()
        log.info("gateway %s stopping", rt.instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
