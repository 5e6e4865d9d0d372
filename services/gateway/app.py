"""aiohttp application: routes and the error middleware (no traceback ever reaches a client)."""

from __future__ import annotations

import logging
import re
import uuid

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.gateway.auth import Auth
from services.gateway.handlers import Gateway
from services.gateway.openapi import build_spec
from shared import errors
from shared.metrics import metrics_handler

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# A client's X-Request-Id is used when it has this form: it names NATS subjects (no dots,
# wildcards or spaces) and SQL keys (room left for the "-k", "-r1", "-t1" suffixes).
CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,48}")
_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def error_response(
    exc: errors.HalfmoonError, request_id: str | None, extra_headers: dict[str, str] | None = None
) -> web.Response:
    headers = dict(extra_headers or {})
    if request_id:
        headers["X-Request-Id"] = request_id
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return web.json_response(exc.body(), status=exc.status, headers=headers)


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


def new_request_id(path: str) -> str:
    prefix = {CHAT_PATH: "chatcmpl", COMPLETIONS_PATH: "cmpl"}.get(path, "req")
    return f"{prefix}-{uuid.uuid4().hex}"


def assign_request_id(request: web.Request) -> None:
    """The client's X-Request-Id if it is a valid one (the handlers still refuse an id
    used before), else a new one; invalid ones are logged, never echoed."""
    given = request.headers.get("X-Request-Id")
    if given is not None and CLIENT_ID.fullmatch(given):
        request["request_id"], request["client_request_id"] = given, True
        return
    request["request_id"] = new_request_id(request.path)
    if given is not None:
        log.info(
            "request %s: X-Request-Id not used (wanted 1-48 of A-Z a-z 0-9 _ -)",
            request["request_id"],
        )


@web.middleware
async def error_middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
    # Every request gets its id first, so any refusal (auth, limits, bad JSON) logs with it.
    assign_request_id(request)
    try:
        resp = await handler(request)
        if not resp.prepared:  # a stream has sent its headers, its own id among them
            resp.headers.setdefault("X-Request-Id", request["request_id"])
        return resp
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
        rid = request.get("request_id")
        log.info(
            "request %s: %d %s: %s %s",
            rid or "-",
            err.status,
            err.code,
            request.method,
            request.path,
        )
        # A 405 must say what is allowed (RFC 9110).
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(err, rid, allow)
    except Exception:  # noqa: BLE001 - logged with its traceback here, never sent
        rid = request.get("request_id")
        log.exception("request %s: unhandled error", rid or "-")
        return error_response(errors.HalfmoonError("internal server error"), rid)


def make_app(gateway: Gateway, max_body_bytes: int, auth: Auth | None = None) -> web.Application:
    """`auth` None: no API keys (the default); else its middleware guards /v1 and /admin."""
    middlewares = [error_middleware] + ([auth.middleware()] if auth is not None else [])
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app.router.add_post(CHAT_PATH, gateway.chat_completions)
    app.router.add_post(COMPLETIONS_PATH, gateway.completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/v1/models/{model}", gateway.model)
    app.router.add_post("/tokenize", gateway.tokenize)
    app.router.add_post("/detokenize", gateway.detokenize)
    app.router.add_get("/version", gateway.version)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", metrics_handler(gateway.metrics.registry))
    app.router.add_get("/admin/state", gateway.admin_state)
    app.router.add_get("/admin/requests/{request_id}", gateway.admin_request)
    app.router.add_get("/admin/kv", gateway.admin_kv)
    app.router.add_get("/openapi.json", openapi_handler(gateway))
    return app


def openapi_handler(gateway: Gateway):  # type: ignore[no-untyped-def]
    """Built on first use, when the app (frozen once serving) holds all its routes."""
    spec: dict = {}

    async def openapi(request: web.Request) -> web.Response:
        if not spec:
            spec.update(
                build_spec(
                    request.app,
                    gateway.prompts.model_name,
                    gateway.settings,
                    getattr(gateway.prompts, "vocab_size", 49152),
                )
            )
        return web.json_response(spec)

    return openapi
