"""HTTP helpers every route group uses: request ids, the JSON body, error responses and the
error middleware (no traceback ever reaches a client). A leaf: it imports nothing else of
the gateway, so any module here may use it."""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from shared import errors

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


def new_request_id(path: str) -> str:
    prefix = {CHAT_PATH: "chatcmpl", COMPLETIONS_PATH: "cmpl"}.get(path, "req")
    return f"{prefix}-{uuid.uuid4().hex}"


def error_response(
    exc: errors.HalfmoonError, request_id: str | None, extra_headers: dict[str, str] | None = None
) -> web.Response:
    headers = dict(extra_headers or {})
    if request_id:
        headers["X-Request-Id"] = request_id
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return web.json_response(exc.body(), status=exc.status, headers=headers)


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
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
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
        return _http_error(request, exc)
    except Exception:  # logged with its traceback here, never sent
        rid = request.get("request_id")
        log.exception("request %s: unhandled error", rid or "-")
        return error_response(errors.HalfmoonError("internal server error"), rid)


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (no route, wrong method, too large) in OpenAI's error shape."""
    err = errors.HalfmoonError(exc.reason, code=_HTTP_CODES.get(exc.status, "http_error"))
    err.status, err.type = exc.status, "invalid_request_error"
    rid = request.get("request_id")
    log.info(
        "request %s: %d %s: %s %s", rid or "-", err.status, err.code, request.method, request.path
    )
    # A 405 must say what is allowed (RFC 9110).
    allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return error_response(err, rid, allow)


# No request field nests deeper than a JSON schema in response_format might; a deeper body
# is refused before anything walks it (the parser itself stops near 1,000 levels, with a
# RecursionError, and what validates or compiles the body downstream could stop anywhere).
MAX_JSON_DEPTH = 64


async def read_json(request: web.Request) -> Any:
    """The request body as JSON, or a 400 that says what is wrong with it: whatever the
    decoding raises is the client's input, never a 500."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise errors.PayloadTooLarge("request body is too large") from None
    body = decode_json(raw)
    check_unicode(body)
    return body


def decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise errors.InvalidRequest(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
        ) from None
    except UnicodeDecodeError:
        raise errors.InvalidRequest("request body is not valid JSON: not UTF-8 text") from None
    except ValueError:  # the one other: an integer past Python's 4,300 digits
        raise errors.InvalidRequest(
            "request body is not valid JSON: a number has too many digits"
        ) from None
    except RecursionError:
        raise _too_deep() from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise _too_deep()
    return body


def _too_deep() -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    )


def json_depth(value: Any) -> int:
    """How deep arrays and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # past the limit the answer is known
            level.extend((child, depth + 1) for child in children)
    return deepest


def check_unicode(body: Any, path: str = "") -> None:
    """A lone surrogate ("\\ud800") is valid JSON but not Unicode: no tokenizer, template
    or log line can take it, so it is a 400 here, naming where it is."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    where = _surrogate_path(body, path)
    raise errors.InvalidRequest(
        f"{where or 'the body'}: text with a lone surrogate is not valid Unicode",
        param=where or None,
    )


def _surrogate_path(value: Any, path: str) -> str:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return ""
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        sub = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _surrogate_path(key, sub):
            return sub
        if found := _surrogate_path(item, sub):
            return found
    return ""


async def write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    """The last words of a stream whose client may have gone already."""
    try:
        await resp.write(data)
    except ConnectionError:
        pass
