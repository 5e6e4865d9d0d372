"""aiohttp application: routes and the error middleware (no traceback ever reaches a client)."""

from __future__ import annotations

import logging

from aiohttp import web

from shared import errors
from services.gateway.handlers import Gateway

log = logging.getLogger(__name__)

_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
               413: "payload_too_large", 415: "unsupported_media_type"}


def error_response(exc: errors.HalfmoonError, request_id: str | None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return web.json_response(exc.body(), status=exc.status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
    try:
        return await handler(request)
    except errors.HalfmoonError as exc:
        rid = request.get("request_id")
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        log.log(level, "request %s: %d %s: %s", rid or "-", exc.status, exc.code, exc.message)
        return error_response(exc, rid)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = errors.HalfmoonError(exc.reason, code=_HTTP_CODES.get(exc.status, "http_error"))
        err.status, err.type = exc.status, "invalid_request_error"
        return error_response(err, request.get("request_id"))
    except Exception:  # noqa: BLE001 - logged with its traceback here, never sent
        rid = request.get("request_id")
        log.exception("request %s: unhandled error", rid or "-")
        return error_response(errors.HalfmoonError("internal server error"), rid)


def make_app(gateway: Gateway, max_body_bytes: int) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/admin/state", gateway.admin_state)
    app.router.add_get("/admin/requests/{request_id}", gateway.admin_request)
    app.router.add_get("/admin/kv", gateway.admin_kv)
    return app
