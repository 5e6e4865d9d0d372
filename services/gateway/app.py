"""The aiohttp application: the route groups (generation, the small endpoints, metrics and
the OpenAPI description) composed over one shared context, behind the error middleware."""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.gateway.auth import Auth
from services.gateway.context import GatewayContext
from services.gateway.extras import ExtraRoutes
from services.gateway.handlers import GenerationRoutes
from services.gateway.httputil import CHAT_PATH, COMPLETIONS_PATH, error_middleware
from services.gateway.openapi import build_spec
from shared.metrics import metrics_handler


class BadHttpLogFilter(logging.Filter):
    """aiohttp logs a client's malformed HTTP (say a NUL in a header) as an ERROR with a
    traceback, echoing the offending line, which may be an Authorization header. It is the
    client's fault and gets a 400: log one INFO line that names the error, not the bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 500) < 500:
            record.msg = f"{record.getMessage()}: {exc.code} {type(exc).__name__}"
            record.args = ()
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def quiet_bad_http_logs() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, BadHttpLogFilter) for f in server_log.filters):
        server_log.addFilter(BadHttpLogFilter())


def make_app(ctx: GatewayContext, max_body_bytes: int, auth: Auth | None = None) -> web.Application:
    """`auth` None: no API keys (the default); else its middleware guards /v1 and /admin."""
    middlewares = [error_middleware] + ([auth.middleware()] if auth is not None else [])
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    gen, extra = GenerationRoutes(ctx), ExtraRoutes(ctx)
    app.add_routes(
        [
            web.post(CHAT_PATH, gen.chat_completions),
            web.post(COMPLETIONS_PATH, gen.completions),
            web.get("/v1/models", extra.models),
            web.get("/v1/models/{model}", extra.model),
            web.post("/tokenize", extra.tokenize),
            web.post("/detokenize", extra.detokenize),
            web.get("/version", extra.version),
            web.get("/health", extra.health),
            web.get("/metrics", metrics_handler(ctx.metrics.registry)),
            web.get("/admin/state", extra.admin_state),
            web.get("/admin/requests/{request_id}", extra.admin_request),
            web.get("/admin/kv", extra.admin_kv),
            web.post("/admin/instances/{instance_id}/role", extra.admin_set_role),
            web.get("/openapi.json", openapi_handler(ctx)),
        ]
    )
    return app


def openapi_handler(ctx: GatewayContext) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Built on first use, when the app (frozen once serving) holds all its routes."""
    spec: dict[str, Any] = {}

    async def openapi(request: web.Request) -> web.Response:
        if not spec:
            spec.update(
                build_spec(
                    request.app,
                    ctx.prompts.model_name,
                    ctx.settings,
                    getattr(ctx.prompts, "vocab_size", 49152),
                )
            )
        return web.json_response(spec)

    return openapi
