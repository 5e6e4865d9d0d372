"""The gateway's OpenAPI 3.1 description, served at GET /openapi.json.

Request bodies come from the pydantic models that validate them (protocol.py), so the
description cannot drift from the checks; response bodies from the small models below.
Every route the app registers is listed, and the settings that bound inputs (served
model, message count, max_tokens) and whether keys are required show in the schemas,
so the document describes this running gateway, not a generic one.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic.json_schema import models_json_schema

from services.gateway.args import GatewaySettings
from services.gateway.auth import Area, area_of
from services.gateway.completion_protocol import CompletionRequest
from services.gateway.extras import DetokenizeRequest, RoleBody, TokenizeRequest
from services.gateway.openapi_models import RESPONSE_MODELS
from services.gateway.openapi_schemas import refine
from services.gateway.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
REF = "#/components/schemas/{model}"


ERRORS = {
    400: "The request is malformed or breaks a limit (body, messages, tokens)",
    401: "No API key, or not a valid one",
    403: "The key is valid but not for this route (admin vs tenant)",
    404: "No such model or record",
    413: "The request body is too large",
    409: "The cluster's state forbids it now (a role switch that would leave a role empty)",
    429: "Rate limit of the key reached, or the cluster is full: retry after Retry-After",
    500: "Internal error (never a traceback)",
    503: "No instance can take the request, or a dependency is down",
    504: "The cluster did not answer in time",
}


def _json(schema: str | dict[str, Any]) -> dict[str, Any]:
    ref = {"$ref": REF.format(model=schema)} if isinstance(schema, str) else schema
    return {"application/json": {"schema": ref}}


@dataclass(frozen=True)
class Operation:
    summary: str
    ok: dict[str, Any]  # the 200 response's content
    errors: tuple[int, ...] = ()
    request: str | None = None  # a schema name
    parameters: list[dict[str, Any]] = field(default_factory=list)
    description: str = ""
    ok_status: int = 200


# Before OpenAPI 3.2 a text/event-stream schema describes one event: here a chunk, an
# error that ended the stream early, or the closing [DONE].
def _sse(chunk: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": REF.format(model=chunk)},
                                {"$ref": REF.format(model="ErrorResponse")},
                            ]
                        },
                    },
                ]
            }
        },
        "description": "with stream=true: `data: {chunk}` events, then `data: [DONE]`",
    }


CHAT_OK = {**_json("ChatCompletion"), "text/event-stream": {"schema": _sse("ChatCompletionChunk")}}
TEXT_OK = {**_json("Completion"), "text/event-stream": {"schema": _sse("Completion")}}
GENERATION_ERRORS = (400, 404, 413, 429, 500, 503, 504)
MODEL_PARAM = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        "Create a chat completion (OpenAI-compatible; stream=true for server-sent events)",
        CHAT_OK,
        GENERATION_ERRORS,
        request="ChatCompletionRequest",
        description="usage.prompt_tokens_details.cached_tokens counts the prompt tokens "
        "served from the prefix cache of the caller's tenant. tool_choice also "
        'takes {"type": "function", "function": {"name": ...}} naming '
        "one of `tools` (left out of the schema, which cannot say 'one of "
        "tools'); guided_json and structured_outputs.json also take the schema "
        "as JSON text.",
    ),
    ("POST", "/v1/completions"): Operation(
        "Create a text completion (OpenAI's legacy API; stream=true for server-sent events)",
        TEXT_OK,
        GENERATION_ERRORS,
        request="CompletionRequest",
        description="prompt: a string, a batch of strings, token ids, or a batch of token id "
        "lists; choices are indexed prompt x n + sample. echo with logprobs "
        "scores every prompt token (the first has none).",
    ),
    ("GET", "/v1/models"): Operation("List the served model", _json("ModelList")),
    ("GET", "/v1/models/{model}"): Operation(
        "The served model's card (404 for any other)",
        _json("ModelCard"),
        (404,),
        parameters=MODEL_PARAM,
    ),
    ("POST", "/tokenize"): Operation(
        "Tokenize text, or chat messages through the chat template (vLLM's shape)",
        _json("TokenizeResponse"),
        (400, 404, 413),
        request="TokenizeRequest",
    ),
    ("POST", "/detokenize"): Operation(
        "Token ids back to text (vLLM's shape)",
        _json("DetokenizeResponse"),
        (400, 404, 413),
        request="DetokenizeRequest",
    ),
    ("GET", "/version"): Operation("The server's version", _json("Version")),
    ("GET", "/health"): Operation(
        "Liveness: ok when the bus is connected", _json("Health"), (503,)
    ),
    ("GET", "/openapi.json"): Operation("This description", _json({"type": "object"})),
    ("GET", "/admin/state"): Operation("Live cluster state from heartbeats", _json("AdminState")),
    ("GET", "/admin/requests/{request_id}"): Operation(
        "One request's record and the conductor's decision for it",
        _json("AdminRequest"),
        (404, 503),
        parameters=[
            {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
    ),
    ("GET", "/admin/kv"): Operation(
        "KV-cache hit rates per instance and window", _json({"type": "object"}), (503,)
    ),
    ("POST", "/admin/instances/{instance_id}/role"): Operation(
        "Switch an engine instance to prefill, decode or colocated, in place",
        _json("RoleSwitchAccepted"),
        (400, 404, 409, 503, 504),
        request="RoleBody",
        parameters=[
            {"name": "instance_id", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        description="202 once the conductor accepted it: the instance stops intake, finishes "
        "what it holds and comes back in the new role (GET /admin/state shows it switching). "
        "409 with the reason when the switch would leave no instance to prefill, or prefill "
        "instances with no decode instance, or the instance is switching already.",
        ok_status=202,
    ),
    ("GET", "/metrics"): Operation(
        "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}
    ),
}


REQUESTS = [
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    RoleBody,
]


def _schemas(model_name: str, settings: GatewaySettings, vocab_size: int) -> dict[str, Any]:
    # Validation mode throughout: a field with a default may be absent from a body.
    pairs = [(m, "validation") for m in [*REQUESTS, *RESPONSE_MODELS]]
    _, defs = models_json_schema(pairs, ref_template=REF)  # type: ignore[arg-type]
    schemas: dict[str, Any] = copy.deepcopy(defs["$defs"])
    refine(schemas, model_name, settings, vocab_size)
    return schemas


def _responses(op: Operation, area: Area, keys: bool) -> dict[str, Any]:
    codes = set(op.errors)
    if keys and area != "public":
        codes |= {401, 403, 503}  # 503: the key store (SQL) did not answer
        if area == "api":
            codes.add(429)
    ok = "OK" if op.ok_status == 200 else "Accepted"
    out: dict[str, Any] = {str(op.ok_status): {"description": ok, "content": op.ok}}
    for code in sorted(codes):
        body = (
            _json("Health") if op.ok == _json("Health") and code == 503 else _json("ErrorResponse")
        )
        out[str(code)] = {"description": ERRORS[code], "content": body}
        if code == 429:
            out[str(code)]["headers"] = {
                "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
            }
    return out


def _operation(method: str, path: str, keys: bool) -> dict[str, Any]:
    op = OPERATIONS.get((method, path))
    if op is None:
        log.warning("route %s %s has no OpenAPI description", method, path)
        op = Operation("(not described)", {"application/json": {"schema": {}}})
    area = area_of(path)
    out: dict[str, Any] = {
        "summary": op.summary,
        "operationId": _op_id(method, path),
        "responses": _responses(op, area, keys),
    }
    if op.description:
        out["description"] = op.description
    if op.parameters:
        out["parameters"] = op.parameters
    if op.request:
        out["requestBody"] = {"required": True, "content": _json(op.request)}
    if keys and area != "public":
        out["security"] = [{"apiKey": []}]
    return out


def _op_id(method: str, path: str) -> str:
    words = [w.strip("{}") for w in path.split("/") if w]
    return method.lower() + "_" + "_".join(w.replace(".", "_") for w in words)


def build_spec(
    app: web.Application, model_name: str, settings: GatewaySettings, vocab_size: int = 49152
) -> dict[str, Any]:
    keys = settings.keys_enabled()
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD" or not path:
            continue
        paths.setdefault(path, {})[route.method.lower()] = _operation(route.method, path, keys)
    components: dict[str, Any] = {"schemas": _schemas(model_name, settings, vocab_size)}
    if keys:
        components["securitySchemes"] = {
            "apiKey": {
                "type": "http",
                "scheme": "bearer",
                "description": "tenant keys for /v1/*, admin keys for /admin/*",
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Halfmoon gateway",
            "version": "1",
            "description": "OpenAI-compatible chat and text completions over a "
            "prefill/decode-disaggregated cluster, plus its admin "
            "JSON.",
        },
        "paths": paths,
        "components": components,
    }


def described(method: str, path: str) -> bool:
    return (method, path) in OPERATIONS
