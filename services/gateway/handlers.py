"""HTTP handlers: validate → tokenize → place → stream, with one terminal record per
(sub-)request. Chat and text completions share the whole path (runs.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web
from nats.aio.client import Client as NATS

from services.gateway.args import GatewaySettings
from services.gateway.chat import ChatOptions, collect_chat, stream_chat
from services.gateway.completion_protocol import parse_completion
from services.gateway.completions import TextOptions, collect_text, stream_text
from services.gateway.extras import Extras
from services.gateway.logprobs import TokenTexts
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompt import PromptBuilder
from services.gateway.protocol import SamplingFields, check_unicode, parse_request
from services.gateway.runs import Fanout, RequestLife, Sub
from services.gateway.streams import Liveness, publish_cancel
from services.gateway.structured import ConstraintChecker, one_constraint, requested
from shared import bus, errors, subjects
from shared.db.records import RecordWriter
from shared.db.schema import RequestRecord, RequestStatus
from shared.db.session import sessionmaker
from shared.hashing import block_hashes
from shared.messages import GenerateRequest, InstanceInfo, Placement, SamplingParams

log = logging.getLogger(__name__)
__all__ = ["Gateway", "RequestLife"]
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks its client is still there
RECENT_IDS = 65536  # request ids remembered here, so a client's X-Request-Id is never reused


class Gateway(Extras):
    def __init__(
        self,
        settings: GatewaySettings,
        nc: NATS,
        records: RecordWriter,
        prompts: PromptBuilder,
        instance_id: str,
    ) -> None:
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
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._texts: TokenTexts | None = None
        self._checker: ConstraintChecker | None = None

    @property
    def texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.prompts.tokenizer)
        return self._texts

    @property
    def checker(self) -> ConstraintChecker:
        if self._checker is None:
            self._checker = ConstraintChecker(self.prompts.tokenizer, self.prompts.vocab_size)
        return self._checker

    async def on_heartbeat(self, msg: Any) -> None:
        try:
            info = InstanceInfo.model_validate_json(msg.data)
        except ValueError:
            return
        self.liveness.beat(info, time.monotonic())

    # -- the two generation endpoints -------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        chat = parse_request(await read_json(request))
        _log_user(request, chat)
        prompt_ids, max_tokens = self.prompts.build(chat)
        sampling = await self._sampling(chat, max_tokens, chat.engine_logprobs())
        if (choice := chat.effective_tool_choice()) not in ("none", "auto"):
            grammar = self.prompts.tool_format.grammar(
                chat.tools or [], choice, chat.parallel_tool_calls
            )
            if sampling.constraint is not None:
                raise errors.InvalidRequest(
                    "tool_choice required or named cannot be combined "
                    "with another structured-output constraint",
                    param="tool_choice",
                )
            sampling.constraint = await self._check("tool_choice", "lark", grammar)
        rid = await self._request_id(request)
        subs = self._subs(request, rid, [prompt_ids], chat, sampling, arrival)
        opts = ChatOptions(
            self.prompts.model_name,
            int(arrival),
            self.texts,
            chat.engine_logprobs(),
            self._stop_ids(sampling),
            self.prompts.tool_format if chat.effective_tool_choice() != "none" else None,
            chat.parallel_tool_calls,
            chat.include_usage(),
            chat.continuous_usage(),
        )
        return await self._serve(
            request,
            Fanout(self, subs, chat.stream),
            rid,
            lambda resp, fan: stream_chat(resp, fan, opts, rid),
            lambda fan: collect_chat(fan, opts, rid),
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        req = parse_completion(await read_json(request))
        _log_user(request, req)
        built = self.prompts.build_completion(req)
        score_only = req.max_tokens == 0
        # Echo with logprobs: every prompt position scored, top k each, by prefill.
        prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
        sampling = await self._sampling(req, 1, req.logprobs)
        rid = await self._request_id(request)
        prompts = [ids for ids, _ in built]
        subs = self._subs(
            request, rid, prompts, req, sampling, arrival, prompt_lps, [max(m, 1) for _, m in built]
        )
        echo_texts = (
            [p if isinstance(p, str) else self.prompts.tokenizer.decode(p) for p in req.prompts()]
            if req.echo
            else []
        )
        opts = TextOptions(
            self.prompts.model_name,
            int(arrival),
            self.texts,
            req.logprobs,
            req.echo,
            echo_texts,
            score_only,
            self._stop_ids(sampling),
            req.include_usage(),
            req.continuous_usage(),
        )
        return await self._serve(
            request,
            Fanout(self, subs, req.stream),
            rid,
            lambda resp, fan: stream_text(resp, fan, opts, rid),
            lambda fan: collect_text(fan, opts, rid),
        )

    async def _sampling(
        self, req: SamplingFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        for tid in [*(req.stop_token_ids or []), *map(int, req.logit_bias or {})]:
            if not 0 <= tid < self.prompts.vocab_size:
                raise errors.InvalidRequest(
                    f"token id {tid} is not in this model's vocabulary "
                    f"(0..{self.prompts.vocab_size - 1})",
                    param="stop_token_ids" if tid in (req.stop_token_ids or []) else "logit_bias",
                )
        sampling = req.sampling(max_tokens, logprobs)
        found = one_constraint(requested(req))
        if found is not None:
            param, c = found
            sampling.constraint = await self._check(param, c.kind, c.spec)
        return sampling

    async def _check(self, param: str, kind: str, spec: str) -> Any:
        from shared.messages import Constraint

        c = Constraint(kind=kind, spec=spec)  # type: ignore[arg-type]
        await asyncio.to_thread(self.checker.check, param, c)
        return c

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        return frozenset(self.texts.special) | frozenset(sampling.stop_token_ids)

    def _subs(
        self,
        request: web.Request,
        rid: str,
        prompts: list[list[int]],
        req: SamplingFields,
        sampling: SamplingParams,
        arrival: float,
        prompt_logprobs: int | None = None,
        max_tokens: list[int] | None = None,
    ) -> list[Sub]:
        """One sub-request per (prompt, sample): choice index prompt x n + sample."""
        tenant = request.get("tenant", "")
        total = len(prompts) * req.n
        if req.n > self.settings.max_choices:
            raise errors.InvalidRequest(
                f"n is {req.n}; this server allows at most {self.settings.max_choices}",
                param="n",
                code="integer_above_max_value",
            )
        if len(prompts) > self.settings.max_prompts:
            raise errors.InvalidRequest(
                f"the batch has {len(prompts)} prompts; this server "
                f"takes at most {self.settings.max_prompts}",
                param="prompt",
                code="array_above_max_length",
            )
        subs = []
        for p, ids in enumerate(prompts):
            hashes = block_hashes(ids, self.settings.block_size, salt=tenant)
            for i in range(req.n):
                k = p * req.n + i
                params = sampling.model_copy(
                    update={
                        "seed": None if sampling.seed is None else sampling.seed + i,
                        "max_tokens": max_tokens[p] if max_tokens else sampling.max_tokens,
                    }
                )
                sub_id = rid if total == 1 else f"{rid}-{k}"
                gen = GenerateRequest(
                    request_id=sub_id,
                    model=self.prompts.model_name,
                    prompt_token_ids=ids,
                    block_hashes=hashes,
                    tenant=tenant,
                    sampling=params,
                    arrival_time=arrival,
                    ttft_slo_ms=req.ttft_slo_ms,
                    tbt_slo_ms=req.tbt_slo_ms,
                    prompt_logprobs=prompt_logprobs,
                )
                subs.append(Sub(k, p, gen, RequestLife(sub_id, arrival)))
                self._remember(sub_id)
        return subs

    async def _serve(
        self,
        request: web.Request,
        fan: Fanout,
        rid: str,
        stream: Callable[[web.StreamResponse, Fanout], Awaitable[None]],
        collect: Callable[[Fanout], Awaitable[dict[str, Any]]],
    ) -> web.StreamResponse:
        self.in_flight += 1
        try:
            await fan.start()
            if fan.stream:
                return await self._stream(request, fan, rid, stream)
            body = await until_disconnected(request, collect(fan), fan)
            return web.json_response(body, headers={"X-Request-Id": rid})
        finally:
            self.in_flight -= 1
            await fan.close()

    async def _stream(
        self,
        request: web.Request,
        fan: Fanout,
        rid: str,
        write: Callable[[web.StreamResponse, Fanout], Awaitable[None]],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": rid,
            }
        )
        await resp.prepare(request)
        try:
            await write(resp, fan)
        except errors.HalfmoonError as exc:
            # Timed out, or the request could not be placed again after a fault: a clear
            # error event, then the end of the stream.
            await _write_quietly(resp, sse_error(exc))
        except (ConnectionResetError, ConnectionError) as exc:
            fan.disconnected(str(exc))
            log.info("request %s: client went away, cancelling", rid)
        return resp

    # -- request ids ----------------------------------------------------------------------
    async def _request_id(self, request: web.Request) -> str:
        """The client's X-Request-Id when it is valid (app.py checked its form) and not
        one this gateway or SQL has seen (a reused id would mix two requests' token
        streams and break the records' batch); otherwise a fresh one."""
        rid: str = request["request_id"]
        if not request.get("client_request_id"):
            return rid
        taken = rid in self._recent
        if not taken and self.records is not None:
            async with sessionmaker(self.records.engine)() as s:
                taken = await s.get(RequestRecord, rid) is not None
        if taken:
            from services.gateway.app import new_request_id

            fresh = new_request_id(request.path)
            log.info(
                "request %s: X-Request-Id %s was used before; serving it as %s", fresh, rid, fresh
            )
            request["request_id"] = fresh
            return fresh
        return rid

    def _remember(self, request_id: str) -> None:
        self._recent[request_id] = None
        while len(self._recent) > RECENT_IDS:
            self._recent.popitem(last=False)

    # -- placement --------------------------------------------------------------------------
    async def _place(
        self,
        gen: GenerateRequest,
        life: RequestLife,
        retarget: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> Placement:
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

    async def _place_new_attempt(
        self, gen: GenerateRequest, retarget: Callable[[str, int], Awaitable[None]]
    ) -> Placement:
        """The placement timed out: most likely the leading conductor took the request and
        died before dispatching it (a failover). It may also have dispatched it late, so
        that id is cancelled everywhere (by the caller) and the request placed once more
        under a new attempt id: the stream follows only the new one, so nothing is lost and
        nothing is doubled."""
        log.warning(
            "request %s: placement timed out; cancelled it, placing a new attempt", gen.request_id
        )
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
                return await bus.request(
                    self.nc,
                    subjects.CONDUCTOR_SCHEDULE,
                    gen,
                    Placement,
                    timeout_s=self.settings.schedule_timeout_s,
                )
            except errors.Unavailable as exc:
                if exc.code not in ("no_responders", "not_leader"):
                    raise
                if time.monotonic() + pause > deadline:
                    raise errors.Unavailable(
                        f"no conductor is placing requests (asked for "
                        f"{self.settings.schedule_retry_s:.0f}s): {exc.message}",
                        code="no_conductor",
                        retry_after_s=2.0,
                    ) from exc
                # Once per request at INFO: during a failover every request passes here.
                log.log(
                    logging.INFO if pause == first_pause else logging.DEBUG,
                    "request %s: %s; asking again for up to %.1fs",
                    gen.request_id,
                    exc.message,
                    deadline - time.monotonic(),
                )
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _placed_again(self, request_id: str, prefill_id: str, decode_id: str) -> None:
        values = {"prefill_instance": prefill_id} if prefill_id else {}
        self.records.request_update(request_id, decode_instance=decode_id or prefill_id, **values)


async def until_disconnected(
    request: web.Request, work: Awaitable[dict[str, Any]], fan: Fanout
) -> dict[str, Any]:
    """Run `work` (a whole response being gathered) while the client is still connected: a
    client that leaves cancels it, and the request everywhere, as a stream's does."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                fan.disconnected("connection closed")
                log.info("request %s: client went away, cancelling", fan.subs[0].gen.request_id)
                # Never sent (nobody is listening): 499, nginx's "client closed request".
                raise errors.HalfmoonError(
                    "client disconnected", code="client_disconnected"
                ).with_status(499)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, errors.HalfmoonError):
                await task


def _log_user(request: web.Request, req: SamplingFields) -> None:
    if req.user:  # the caller's tag for its end user: in the log, next to the request id
        log.info("request %s: user %r", request["request_id"], req.user[:200])


def sse_error(exc: errors.HalfmoonError) -> bytes:
    from services.gateway.bodies import sse

    return sse(exc.body()) + sse("[DONE]")


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise errors.PayloadTooLarge("request body is too large") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise errors.InvalidRequest("request body is not valid JSON") from None
    check_unicode(body)
    return body


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionError:
        pass
