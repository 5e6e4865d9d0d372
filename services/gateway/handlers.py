"""HTTP handlers: validate → tokenize → place → stream, with one terminal record per request."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from nats.aio.client import Client as NATS

from shared import bus, errors, subjects
from shared.db.records import RecordWriter
from shared.db.schema import DecisionRecord, RequestRecord, RequestStatus
from shared.db.session import sessionmaker
from shared.db.stats import kv_hit_rates
from shared.hashing import block_hashes
from shared.messages import (CancelRequest, FinishReason, GenerateRequest, InstanceInfo,
                             Placement, TokenEvent, Usage)
from services.gateway.args import GatewaySettings
from services.gateway.prompt import PromptBuilder
from services.gateway.protocol import (ChatCompletionRequest, chunk_body, completion_body,
                                       models_body, now_s, parse_request)
from services.gateway.streams import TokenStream

log = logging.getLogger(__name__)


@dataclass
class RequestLife:
    """What the terminal SQL record will say about one accepted request."""

    request_id: str
    arrival: float
    status: RequestStatus = RequestStatus.FAILED
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    usage: Usage | None = None
    text_parts: list[str] = field(default_factory=list)

    def on_event(self, event: TokenEvent) -> None:
        if self.first_token_time is None and event.token_ids:
            self.first_token_time = time.time()
        if event.text:
            self.text_parts.append(event.text)
        if event.usage is not None:
            self.usage = event.usage
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason.value
            if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.status = RequestStatus.COMPLETED

    def terminal_values(self) -> dict[str, Any]:
        now = time.time()
        values: dict[str, Any] = {"finish_time": now, "e2e_ms": (now - self.arrival) * 1e3,
                                  "finish_reason": self.finish_reason, "error": self.error}
        if self.first_token_time is not None:
            values["first_token_time"] = self.first_token_time
            values["ttft_ms"] = (self.first_token_time - self.arrival) * 1e3
        if self.usage is not None:
            values["completion_tokens"] = self.usage.completion_tokens
            values["cached_tokens"] = self.usage.cached_tokens
        return values


def _row(row: Any) -> dict[str, Any] | None:
    if row is None:
        return None
    return {c.name: getattr(row, c.name) for c in row.__table__.columns}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Gateway:
    def __init__(self, settings: GatewaySettings, nc: NATS, records: RecordWriter,
                 prompts: PromptBuilder, instance_id: str) -> None:
        self.settings = settings
        self.nc = nc
        self.records = records
        self.prompts = prompts
        self.instance_id = instance_id
        self.started_at = time.time()
        self.instances: dict[str, InstanceInfo] = {}
        self.in_flight = 0

    # -- small endpoints ----------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_body(self.prompts.model_name, self.started_at))

    async def health(self, request: web.Request) -> web.Response:
        ok = self.nc.is_connected
        return web.json_response({"status": "ok" if ok else "degraded", "nats": ok},
                                 status=200 if ok else 503)

    async def admin_state(self, request: web.Request) -> web.Response:
        now = time.time()
        instances = [dict(info.model_dump(mode="json"), heartbeat_age_s=round(now - info.sent_at, 3))
                     for info in self.instances.values()]
        return web.json_response({"gateway": self.instance_id, "uptime_s": now - self.started_at,
                                  "in_flight": self.in_flight, "instances": instances})

    async def admin_request(self, request: web.Request) -> web.Response:
        """One request's record and the conductor's decision for it (why it went where)."""
        rid = request.match_info["request_id"]
        async with sessionmaker(self.records.engine)() as s:
            rec = await s.get(RequestRecord, rid)
            dec = await s.get(DecisionRecord, rid)
        if rec is None and dec is None:
            raise errors.HalfmoonError(f"no request {rid}", code="not_found").with_status(404)
        return web.json_response({"request": _row(rec), "decision": _row(dec)})

    async def admin_kv(self, request: web.Request) -> web.Response:
        """Token-weighted KV hit rates per prefill instance and for the cluster, by window."""
        return web.json_response(await kv_hit_rates(self.records.engine))

    async def on_heartbeat(self, msg: Any) -> None:
        try:
            info = InstanceInfo.model_validate_json(msg.data)
        except ValueError:
            return
        self.instances[info.instance_id] = info

    # -- chat completions ---------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        request["request_id"] = request_id
        arrival = time.time()
        body = await _read_json(request)
        chat = parse_request(body)
        prompt_ids, max_tokens = self.prompts.build(chat)
        gen = GenerateRequest(
            request_id=request_id, model=self.prompts.model_name, prompt_token_ids=prompt_ids,
            block_hashes=block_hashes(prompt_ids, self.settings.block_size),
            sampling=chat.sampling(max_tokens), arrival_time=arrival,
            ttft_slo_ms=chat.ttft_slo_ms, tbt_slo_ms=chat.tbt_slo_ms)
        self.records.request_accepted(
            id=request_id, model=gen.model, status=RequestStatus.QUEUED.value, arrival_time=arrival,
            prompt_tokens=len(prompt_ids), max_tokens=max_tokens, stream=chat.stream)
        life = RequestLife(request_id, arrival)
        self.in_flight += 1
        stream = await TokenStream(self.nc, request_id).open()
        try:
            placement = await self._place(gen, life)
            self.records.request_update(request_id, status=RequestStatus.RUNNING.value,
                                        prefill_instance=placement.prefill_id,
                                        decode_instance=placement.decode_id)
            if chat.stream:
                return await self._stream(request, chat, stream, life)
            return await self._collect(chat, stream, life)
        finally:
            self.in_flight -= 1
            await stream.close()
            self.records.request_finished(request_id, life.status.value, **life.terminal_values())

    async def _place(self, gen: GenerateRequest, life: RequestLife) -> Placement:
        try:
            return await bus.request(self.nc, subjects.CONDUCTOR_SCHEDULE, gen, Placement,
                                     timeout_s=self.settings.schedule_timeout_s)
        except errors.HalfmoonError as exc:
            life.status = RequestStatus.REJECTED if exc.status == 429 else RequestStatus.FAILED
            life.error = f"{exc.code}: {exc.message}"
            if isinstance(exc, errors.Timeout):
                # The conductor may have dispatched it after all: make sure nobody computes it.
                await self._cancel(gen.request_id, "placement timed out")
            raise

    async def _collect(self, chat: ChatCompletionRequest, stream: TokenStream,
                       life: RequestLife) -> web.Response:
        try:
            async for event in stream.events(self.settings.first_token_timeout_s,
                                             self.settings.token_timeout_s):
                if event.error is not None:
                    life.error = f"{event.error.code}: {event.error.message}"
                    raise errors.from_code(event.error.code, event.error.message,
                                            status=event.error.status)
                life.on_event(event)
        except errors.Timeout as exc:
            life.error = f"timeout: {exc.message}"
            await self._cancel(life.request_id, "timed out")
            raise
        body = completion_body(life.request_id, self.prompts.model_name, int(life.arrival),
                               "".join(life.text_parts), life.finish_reason, life.usage)
        return web.json_response(body, headers={"X-Request-Id": life.request_id})

    async def _stream(self, request: web.Request, chat: ChatCompletionRequest,
                      stream: TokenStream, life: RequestLife) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": life.request_id})
        await resp.prepare(request)
        model, created, rid = self.prompts.model_name, now_s(), life.request_id
        try:
            await resp.write(sse(chunk_body(rid, model, created, {"role": "assistant", "content": ""})))
            async for event in stream.events(self.settings.first_token_timeout_s,
                                             self.settings.token_timeout_s):
                if event.error is not None:
                    life.error = f"{event.error.code}: {event.error.message}"
                    await resp.write(sse(errors.from_code(event.error.code, event.error.message,
                                            status=event.error.status).body()))
                    break
                life.on_event(event)
                await self._write_event(resp, chat, event, rid, model, created)
            await resp.write(sse("[DONE]"))
        except errors.Timeout as exc:
            life.error = f"timeout: {exc.message}"
            await self._cancel(rid, "timed out")
            await _write_quietly(resp, sse(exc.body()) + sse("[DONE]"))
        except (ConnectionResetError, ConnectionError) as exc:
            life.status, life.error = RequestStatus.CANCELLED, f"client disconnected: {exc}"
            life.finish_reason = FinishReason.CANCELLED.value
            log.info("request %s: client went away, cancelling", rid)
            await self._cancel(rid, "client disconnected")
        return resp

    async def _write_event(self, resp: web.StreamResponse, chat: ChatCompletionRequest,
                           event: TokenEvent, rid: str, model: str, created: int) -> None:
        if event.text:
            await resp.write(sse(chunk_body(rid, model, created, {"content": event.text})))
        if event.finish_reason is not None:
            await resp.write(sse(chunk_body(rid, model, created, {}, event.finish_reason.value)))
            if chat.stream_options and chat.stream_options.include_usage:
                await resp.write(sse(chunk_body(rid, model, created, {}, usage=event.usage,
                                                with_choice=False)))

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.nc.publish(subjects.CANCEL,
                                  CancelRequest(request_id=request_id, reason=reason).encode())
        except Exception as exc:  # noqa: BLE001 - best effort; workers also time out
            log.warning("request %s: cancel not sent: %s", request_id, exc)


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise errors.PayloadTooLarge("request body is too large") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise errors.InvalidRequest("request body is not valid JSON") from None


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionError:
        pass
