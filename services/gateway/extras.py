"""The small endpoints: models, health, version, tokenize / detokenize (vLLM's shapes), and
the admin JSON."""

from __future__ import annotations

import time
from importlib import metadata
from typing import Any

from aiohttp import web
from pydantic import Field, model_validator

from services.gateway.bodies import model_card, models_body
from services.gateway.context import GatewayContext
from services.gateway.httputil import read_json
from services.gateway.protocol import ChatCompletionRequest, ChatMessage, Tool, parse_body
from services.gateway.validation import Integral, Strict
from shared import bus, errors, subjects
from shared.db.schema import DecisionRecord, RequestRecord
from shared.db.session import sessionmaker
from shared.db.stats import kv_hit_rates
from shared.messages import EngineRole
from shared.role_messages import RoleChange, RoleChangeReply


class TokenizeRequest(Strict):
    """Text (`prompt`) or chat `messages` (through the chat template, tools included)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool = True  # text only: what the tokenizer adds (BOS, for some)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise errors.InvalidRequest("give either prompt or messages", param="prompt")
        return self


class RoleBody(Strict):
    """POST /admin/instances/{id}/role: the role an engine instance should serve as."""

    role: EngineRole  # colocated: prefills and decodes its own requests


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Integral] = Field(max_length=1 << 20)


def version() -> str:
    try:
        return metadata.version("halfmoon")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _row(row: Any) -> dict[str, Any] | None:
    if row is None:
        return None
    return {c.name: getattr(row, c.name) for c in row.__table__.columns}


class ExtraRoutes:
    """Everything but generation (app.py routes these here)."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            models_body(
                self.ctx.prompts.model_name, self.ctx.started_at, self.ctx.prompts.max_model_len
            )
        )

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self.ctx.prompts.check_model(name)
        return web.json_response(
            model_card(name, self.ctx.started_at, self.ctx.prompts.max_model_len)
        )

    async def health(self, request: web.Request) -> web.Response:
        ok = self.ctx.nc.is_connected
        return web.json_response(
            {"status": "ok" if ok else "degraded", "nats": ok}, status=200 if ok else 503
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version()})

    async def tokenize(self, request: web.Request) -> web.Response:
        req: TokenizeRequest = parse_body(TokenizeRequest, await read_json(request))
        p = self.ctx.prompts
        if req.model is not None:
            p.check_model(req.model)
        if req.prompt is not None:
            p.check_chars(len(req.prompt), "prompt")
            ids = p.encode(req.prompt, req.add_special_tokens)
        else:
            chat = ChatCompletionRequest.model_validate(
                {"model": p.model_name, "messages": req.messages, "tools": req.tools}
            )
            messages, tools = p.render_messages(chat)
            p.check_chars(sum(len(str(m.get("content") or "")) for m in messages), "messages")
            ids = p.tokenize(messages, tools, req.add_generation_prompt)
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": p.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if req.return_token_strs:
            body["token_strs"] = [self.ctx.texts.of(t)[0] for t in ids]
        return web.json_response(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        req: DetokenizeRequest = parse_body(DetokenizeRequest, await read_json(request))
        p = self.ctx.prompts
        if req.model is not None:
            p.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < p.vocab_size), None)
        if bad is not None:
            raise errors.InvalidRequest(
                f"token id {bad} is not in this model's vocabulary (0..{p.vocab_size - 1})",
                param="tokens",
            )
        return web.json_response({"prompt": p.decode(req.tokens)})

    async def admin_state(self, request: web.Request) -> web.Response:
        now = time.time()
        instances = [
            dict(info.model_dump(mode="json"), heartbeat_age_s=round(now - info.sent_at, 3))
            for info in self.ctx.liveness.infos()
        ]
        return web.json_response(
            {
                "gateway": self.ctx.instance_id,
                "uptime_s": now - self.ctx.started_at,
                "in_flight": self.ctx.in_flight,
                "instances": instances,
            }
        )

    async def admin_request(self, request: web.Request) -> web.Response:
        """One request's record and the conductor's decision for it (why it went where)."""
        rid = request.match_info["request_id"]
        async with sessionmaker(self.ctx.records.engine)() as s:
            rec = await s.get(RequestRecord, rid)
            dec = await s.get(DecisionRecord, rid)
        if rec is None and dec is None:
            raise errors.HalfmoonError(f"no request {rid}", code="not_found").with_status(404)
        return web.json_response({"request": _row(rec), "decision": _row(dec)})

    async def admin_kv(self, request: web.Request) -> web.Response:
        """Token-weighted KV hit rates per prefill instance and for the cluster, by window."""
        return web.json_response(await kv_hit_rates(self.ctx.records.engine))

    async def admin_set_role(self, request: web.Request) -> web.Response:
        """Switch an engine instance's role in place: 202 once the conductor accepted it
        (the drain goes on; /admin/state shows the instance "switching", then in its new
        role), 409 with the reason when it refuses."""
        body: RoleBody = parse_body(RoleBody, await read_json(request))
        instance_id = request.match_info["instance_id"]
        try:
            change = RoleChange(instance_id=instance_id, role=body.role, source="admin")
        except ValueError:
            raise errors.InvalidRequest("not an instance id", param="instance_id") from None
        reply = await bus.request(
            self.ctx.nc, subjects.CONDUCTOR_ROLE, change, RoleChangeReply, timeout_s=5.0
        )
        return web.json_response(reply.model_dump(mode="json", exclude={"v"}), status=202)
