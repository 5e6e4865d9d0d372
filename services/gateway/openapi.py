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
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.gateway.args import GatewaySettings
from services.gateway.auth import Area, area_of
from services.gateway.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
REF = "#/components/schemas/{model}"


# -- response bodies (documentation only: protocol.py builds the real ones) -------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache (whole blocks)


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage | None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]  # empty in the last chunk with include_usage
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    nats: bool


class AdminState(BaseModel):
    gateway: str
    uptime_s: float
    in_flight: int
    instances: list[dict[str, Any]]


class AdminRequest(BaseModel):
    request: dict[str, Any] | None
    decision: dict[str, Any] | None


RESPONSE_MODELS: list[type[BaseModel]] = [ErrorResponse, ChatCompletion, ChatCompletionChunk,
                                          ModelList, Health, AdminState, AdminRequest]

ERRORS = {
    400: "The request is malformed or breaks a limit (body, messages, tokens)",
    401: "No API key, or not a valid one",
    403: "The key is valid but not for this route (admin vs tenant)",
    404: "No such model or record",
    413: "The request body is too large",
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


# Before OpenAPI 3.2 a text/event-stream schema describes one event: here a chunk, an
# error that ended the stream early, or the closing [DONE].
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    {"const": "[DONE]"},
    {"type": "string", "contentMediaType": "application/json",
     "contentSchema": {"anyOf": [{"$ref": REF.format(model="ChatCompletionChunk")},
                                 {"$ref": REF.format(model="ErrorResponse")}]}}]}},
    "description": "with stream=true: `data: {chunk}` events, then `data: [DONE]`"}
CHAT_OK = {**_json("ChatCompletion"), "text/event-stream": {"schema": SSE_EVENT}}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        "Create a chat completion (OpenAI-compatible; stream=true for server-sent events)",
        CHAT_OK, (400, 404, 413, 429, 500, 503, 504), request="ChatCompletionRequest",
        description="usage.prompt_tokens_details.cached_tokens counts the prompt tokens "
                    "served from the prefix cache of the caller's tenant."),
    ("GET", "/v1/models"): Operation("List the served model", _json("ModelList")),
    ("GET", "/health"): Operation("Liveness: ok when the bus is connected", _json("Health"),
                                  (503,)),
    ("GET", "/openapi.json"): Operation("This description", _json({"type": "object"})),
    ("GET", "/admin/state"): Operation("Live cluster state from heartbeats",
                                       _json("AdminState")),
    ("GET", "/admin/requests/{request_id}"): Operation(
        "One request's record and the conductor's decision for it", _json("AdminRequest"),
        (404, 503), parameters=[{"name": "request_id", "in": "path", "required": True,
                                 "schema": {"type": "string"}}]),
    ("GET", "/admin/kv"): Operation("KV-cache hit rates per instance and window",
                                    _json({"type": "object"}), (503,)),
    ("GET", "/metrics"): Operation("Prometheus metrics", {"text/plain": {"schema": {
        "type": "string"}}}),
}


_NON_BLANK = {"type": "string", "pattern": "\\S"}
NON_BLANK_MESSAGE = {
    "type": "object", "required": ["content"],
    "description": "at least one message has some text",
    "properties": {"content": {"anyOf": [_NON_BLANK, {
        "type": "array", "contains": {"type": "object", "required": ["text"],
                                      "properties": {"text": _NON_BLANK}}}]}}}


def _schemas(model_name: str, settings: GatewaySettings) -> dict[str, Any]:
    # Validation mode throughout: a field with a default may be absent from a body.
    pairs = [(m, "validation") for m in [ChatCompletionRequest, *RESPONSE_MODELS]]
    _, defs = models_json_schema(pairs, ref_template=REF)  # type: ignore[arg-type]
    schemas = copy.deepcopy(defs["$defs"])
    props = schemas["ChatCompletionRequest"]["properties"]
    props["model"]["enum"] = [model_name]  # any other name is a 404
    props["messages"]["contains"] = NON_BLANK_MESSAGE  # all-blank messages are a 400
    if settings.max_messages:
        props["messages"]["maxItems"] = settings.max_messages
    if settings.max_output_tokens:
        for name in ("max_tokens", "max_completion_tokens"):
            for branch in props[name]["anyOf"]:
                if branch.get("type") == "integer":
                    branch["maximum"] = settings.max_output_tokens
    return schemas


def _responses(op: Operation, area: Area, keys: bool) -> dict[str, Any]:
    codes = set(op.errors)
    if keys and area != "public":
        codes |= {401, 403, 503}  # 503: the key store (SQL) did not answer
        if area == "api":
            codes.add(429)
    out: dict[str, Any] = {"200": {"description": "OK", "content": op.ok}}
    for code in sorted(codes):
        body = _json("Health") if op.ok == _json("Health") and code == 503 else \
            _json("ErrorResponse")
        out[str(code)] = {"description": ERRORS[code], "content": body}
        if code == 429:
            out[str(code)]["headers"] = {"Retry-After": {
                "description": "seconds to wait", "schema": {"type": "integer"}}}
    return out


def _operation(method: str, path: str, keys: bool) -> dict[str, Any]:
    op = OPERATIONS.get((method, path))
    if op is None:
        log.warning("route %s %s has no OpenAPI description", method, path)
        op = Operation("(not described)", {"application/json": {"schema": {}}})
    area = area_of(path)
    out: dict[str, Any] = {"summary": op.summary, "operationId": _op_id(method, path),
                           "responses": _responses(op, area, keys)}
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


def build_spec(app: web.Application, model_name: str, settings: GatewaySettings) -> dict[str, Any]:
    keys = settings.keys_enabled()
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD" or not path:
            continue
        paths.setdefault(path, {})[route.method.lower()] = _operation(route.method, path, keys)
    components: dict[str, Any] = {"schemas": _schemas(model_name, settings)}
    if keys:
        components["securitySchemes"] = {"apiKey": {
            "type": "http", "scheme": "bearer",
            "description": "tenant keys for /v1/*, admin keys for /admin/*"}}
    return {"openapi": "3.1.0",
            "info": {"title": "Halfmoon gateway", "version": "1",
                     "description": "OpenAI-compatible chat completions over a prefill/decode-"
                                    "disaggregated cluster, plus its admin JSON."},
            "paths": paths, "components": components}


def described(method: str, path: str) -> bool:
    return (method, path) in OPERATIONS
