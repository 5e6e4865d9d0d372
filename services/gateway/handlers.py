"""HTTP handlers: validate → tokenize → place → stream, with one terminal record per request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web
from nats.aio.client import Client as NATS

from shared import bus, errors, subjects
from shared.db.records import RecordWriter
from shared.db.schema import DecisionRecord, RequestRecord, RequestStatus
from shared.db.session import sessionmaker
from shared.db.stats import kv_hit_rates
from shared.hashing import block_hashes
from shared.messages import (FinishReason, GenerateRequest, InstanceInfo, Placement,
                             TokenEvent, Usage)
from services.gateway.args import GatewaySettings
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompt import PromptBuilder
from services.gateway.protocol import (ChatCompletionRequest, chunk_body, completion_body,
                                       models_body, now_s, parse_request)
from services.gateway.streams import Follower, Liveness, TokenStream, publish_cancel

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
    # Phase boundaries for the console's timeline: the placement reply, and the first token
    # from an instance other than the one that sent the first (the decode side of a handoff).
    dispatch_time: float | None = None
    decode_first_token_time: float | None = None
    first_instance: str = ""
    metrics: GatewayMetrics | None = None
    last_token_time: float | None = None
    num_tokens: int = 0

    def on_event(self, event: TokenEvent) -> None:
        if event.token_ids:
            now = time.time()
            if self.metrics is not None:
                self.metrics.token_event(self.arrival, self.last_token_time, now)
            if self.first_token_time is None:
                self.first_token_time, self.first_instance = now, event.instance_id
            elif (self.decode_first_token_time is None and event.instance_id
                  and event.instance_id != self.first_instance):
                self.decode_first_token_time = now
            self.last_token_time = now
            self.num_tokens += len(event.token_ids)
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
        for key in ("dispatch_time", "decode_first_token_time"):
            if getattr(self, key) is not None:
                values[key] = getattr(self, key)
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
        # Every instance's last heartbeat: who can still serve a stream, and /admin/state.
        self.liveness = Liveness(settings.instance_expiry_s)
        self.in_flight = 0
        self.metrics = GatewayMetrics(lambda: self.in_flight)

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
                     for info in self.liveness.infos()]
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
        self.liveness.beat(info, time.monotonic())

    # -- chat completions ---------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        request_id = request["request_id"]  # a chatcmpl- id, from error_middleware (app.py)
        # The tenant comes from the API key (auth.py); "" without keys. It salts the prefix
        # hashes, so no tenant can hit (or time) another's cached blocks.
        tenant = request.get("tenant", "")
        arrival = time.time()
        body = await _read_json(request)
        chat = parse_request(body)
        prompt_ids, max_tokens = self.prompts.build(chat)
        gen = GenerateRequest(
            request_id=request_id, model=self.prompts.model_name, prompt_token_ids=prompt_ids,
            block_hashes=block_hashes(prompt_ids, self.settings.block_size, salt=tenant),
            tenant=tenant,
            sampling=chat.sampling(max_tokens), arrival_time=arrival,
            ttft_slo_ms=chat.ttft_slo_ms, tbt_slo_ms=chat.tbt_slo_ms)
        self.records.request_accepted(
            id=request_id, model=gen.model, tenant=tenant, status=RequestStatus.QUEUED.value,
            arrival_time=arrival,
            prompt_tokens=len(prompt_ids), max_tokens=max_tokens, stream=chat.stream)
        life = RequestLife(request_id, arrival, metrics=self.metrics)
        self.in_flight += 1
        stream = await TokenStream(self.nc, request_id, self.settings.gap_timeout_s).open()
        follow = Follower(self.nc, self.settings, self.liveness, stream, gen,
                          lambda g: self._place(g, life), lambda p, d: self._placed_again(
                              request_id, p, d))
        try:
            placement = await self._place(gen, life, stream.retarget)
            follow.placed(placement)
            self.records.request_update(request_id, status=RequestStatus.RUNNING.value,
                                        prefill_instance=placement.prefill_id,
                                        # colocated: the prefill instance decodes too
                                        decode_instance=placement.decode_id or placement.prefill_id)
            if chat.stream:
                return await self._stream(request, chat, follow, life)
            return await self._collect(chat, follow, life)
        finally:
            self.in_flight -= 1
            if follow.attempt is not None and life.status != RequestStatus.COMPLETED:
                # Whatever is left of it, anywhere: one cancel for every way it can end.
                await follow.cancel(life.error or "request ended")
            await stream.close()
            self.records.request_finished(request_id, life.status.value, **life.terminal_values())
            self.metrics.finished(life, len(prompt_ids))

    async def _place(self, gen: GenerateRequest, life: RequestLife,
                     retarget: Callable[[str, int], Awaitable[None]] | None = None) -> Placement:
        try:
            try:
                placement = await self._ask_conductor(gen)
            except errors.Timeout:
                # The conductor may have dispatched it after all: make sure nobody computes it.
                await publish_cancel(self.nc, gen.request_id, "placement timed out")
                if retarget is None:
                    raise
                placement = await self._place_new_attempt(gen, retarget)
            life.dispatch_time = time.time()  # the prefill instance has acknowledged the job
            return placement
        except errors.HalfmoonError as exc:
            self.metrics.rejected(exc)
            life.status = RequestStatus.REJECTED if exc.status == 429 else RequestStatus.FAILED
            life.error = f"{exc.code}: {exc.message}"
            raise

    async def _place_new_attempt(self, gen: GenerateRequest,
                                 retarget: Callable[[str, int], Awaitable[None]]) -> Placement:
        """The placement timed out: most likely the leading conductor took the request and
        died before dispatching it (a failover). It may also have dispatched it late, so
        that id is cancelled everywhere (by the caller) and the request placed once more
        under a new attempt id: the stream follows only the new one, so nothing is lost and
        nothing is doubled."""
        log.warning("request %s: placement timed out; cancelled it, placing a new attempt",
                    gen.request_id)
        again = gen.model_copy(update={"request_id": f"{gen.request_id}-t1"})
        await retarget(again.request_id, 0)
        try:
            return await self._ask_conductor(again)
        except errors.Timeout:
            await publish_cancel(self.nc, again.request_id, "placement timed out twice")
            raise

    async def _ask_conductor(self, gen: GenerateRequest) -> Placement:
        """The conductor's placement. While no conductor leads (the leader died and a standby
        has not taken over yet: no responders, or a deposed leader's "not_leader"), nobody
        dispatched the request, so asking again is safe: retry with backoff until
        schedule_retry_s, then fail with 503. A timeout is not retried: the conductor that
        timed out may have dispatched it (the caller cancels it instead)."""
        deadline = time.monotonic() + self.settings.schedule_retry_s
        pause = first_pause = 0.05
        while True:
            try:
                return await bus.request(self.nc, subjects.CONDUCTOR_SCHEDULE, gen, Placement,
                                         timeout_s=self.settings.schedule_timeout_s)
            except errors.Unavailable as exc:
                if exc.code not in ("no_responders", "not_leader"):
                    raise
                if time.monotonic() + pause > deadline:
                    raise errors.Unavailable(
                        f"no conductor is placing requests (asked for "
                        f"{self.settings.schedule_retry_s:.0f}s): {exc.message}",
                        code="no_conductor", retry_after_s=2.0) from exc
                # Once per request at INFO: during a failover every request passes here.
                log.log(logging.INFO if pause == first_pause else logging.DEBUG,
                        "request %s: %s; asking again for up to %.1fs", gen.request_id,
                        exc.message, deadline - time.monotonic())
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _placed_again(self, request_id: str, prefill_id: str, decode_id: str) -> None:
        values = {"prefill_instance": prefill_id} if prefill_id else {}
        self.records.request_update(request_id, decode_instance=decode_id or prefill_id, **values)

    async def _collect(self, chat: ChatCompletionRequest, follow: Follower,
                       life: RequestLife) -> web.Response:
        try:
            async for event in follow.events():
                if event.error is not None:
                    life.error = f"{event.error.code}: {event.error.message}"
                    raise errors.from_code(event.error.code, event.error.message,
                                            status=event.error.status)
                life.on_event(event)
        except errors.HalfmoonError as exc:
            life.error = life.error or f"{exc.code}: {exc.message}"
            raise
        body = completion_body(life.request_id, self.prompts.model_name, int(life.arrival),
                               "".join(life.text_parts), life.finish_reason, life.usage)
        return web.json_response(body, headers={"X-Request-Id": life.request_id})

    async def _stream(self, request: web.Request, chat: ChatCompletionRequest,
                      follow: Follower, life: RequestLife) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": life.request_id})
        await resp.prepare(request)
        model, created, rid = self.prompts.model_name, now_s(), life.request_id
        try:
            await resp.write(sse(chunk_body(rid, model, created, {"role": "assistant", "content": ""})))
            async for event in follow.events():
                if event.error is not None:
                    life.error = f"{event.error.code}: {event.error.message}"
                    await resp.write(sse(errors.from_code(event.error.code, event.error.message,
                                            status=event.error.status).body()))
                    break
                life.on_event(event)
                await self._write_event(resp, chat, event, rid, model, created)
            await resp.write(sse("[DONE]"))
        except errors.HalfmoonError as exc:
            # Timed out, or the request could not be placed again after a fault: a clear
            # error event, then the end of the stream.
            life.error = life.error or f"{exc.code}: {exc.message}"
            await _write_quietly(resp, sse(exc.body()) + sse("[DONE]"))
        except (ConnectionResetError, ConnectionError) as exc:
            life.status, life.error = RequestStatus.CANCELLED, f"client disconnected: {exc}"
            life.finish_reason = FinishReason.CANCELLED.value
            log.info("request %s: client went away, cancelling", rid)
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
