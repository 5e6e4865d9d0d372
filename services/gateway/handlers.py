"""The two generation endpoints, chat and text completions: validate → tokenize → place →
stream, with one terminal record per (sub-)request. Both share the whole path (runs.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from services.gateway.bodies import sse
from services.gateway.chat import ChatOptions, collect_chat, stream_chat
from services.gateway.completion_protocol import parse_completion
from services.gateway.completions import TextOptions, collect_text, stream_text
from services.gateway.context import GatewayContext
from services.gateway.httputil import read_json, write_quietly
from services.gateway.life import RequestLife
from services.gateway.placement import ConductorPlacer
from services.gateway.protocol import SamplingFields, parse_request
from services.gateway.request_ids import RequestIds
from services.gateway.runs import Fanout, Sub
from services.gateway.structured import one_constraint, requested
from services.gateway.tools import skip_special_tokens
from shared import errors
from shared.hashing import block_hashes
from shared.messages import Constraint, GenerateRequest, SamplingParams

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks its client is still there


class GenerationRoutes:
    """POST /v1/chat/completions and /v1/completions (app.py routes them here)."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx
        self.placer = ConductorPlacer(ctx.settings, ctx.nc, ctx.records, ctx.metrics)
        self.ids = RequestIds(ctx.records)

    # -- the two generation endpoints -------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        chat = parse_request(await read_json(request))
        _log_user(request, chat)
        prompt_ids, max_tokens = self.ctx.prompts.build(chat)
        sampling = await self._sampling(chat, max_tokens, chat.engine_logprobs())
        if (choice := chat.effective_tool_choice()) not in ("none", "auto"):
            grammar = self.ctx.prompts.tool_format.grammar(
                chat.tools or [], choice, chat.parallel_tool_calls
            )
            if sampling.constraint is not None:
                raise errors.InvalidRequest(
                    "tool_choice required or named cannot be combined "
                    "with another structured-output constraint",
                    param="tool_choice",
                )
            tools = Constraint(kind="lark", spec=grammar)
            sampling.constraint = await self._check("tool_choice", tools)
        tool_format = self.ctx.prompts.reply_format(chat)
        # A format whose marker is a special token needs the engine to keep it in the text.
        sampling.skip_special_tokens = skip_special_tokens(tool_format)
        rid = await self.ids.settle(request)
        subs = self._subs(request, rid, [prompt_ids], chat, sampling, arrival)
        opts = ChatOptions(
            self.ctx.prompts.model_name,
            int(arrival),
            self.ctx.texts,
            chat.engine_logprobs(),
            self._stop_ids(sampling),
            tool_format,
            chat.parallel_tool_calls,
            chat.include_usage(),
            chat.continuous_usage(),
        )
        return await self._serve(
            request,
            Fanout(self.ctx, self.placer, subs, chat.stream),
            rid,
            lambda resp, fan: stream_chat(resp, fan, opts, rid),
            lambda fan: collect_chat(fan, opts, rid),
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        req = parse_completion(await read_json(request))
        _log_user(request, req)
        built = self.ctx.prompts.build_completion(req)
        score_only = req.max_tokens == 0
        # Echo with logprobs: every prompt position scored, top k each, by prefill.
        prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
        sampling = await self._sampling(req, 1, req.logprobs)
        rid = await self.ids.settle(request)
        prompts = [ids for ids, _ in built]
        subs = self._subs(
            request, rid, prompts, req, sampling, arrival, prompt_lps, [max(m, 1) for _, m in built]
        )
        echo_texts = (
            [p if isinstance(p, str) else self.ctx.prompts.decode(p) for p in req.prompts()]
            if req.echo
            else []
        )
        opts = TextOptions(
            self.ctx.prompts.model_name,
            int(arrival),
            self.ctx.texts,
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
            Fanout(self.ctx, self.placer, subs, req.stream),
            rid,
            lambda resp, fan: stream_text(resp, fan, opts, rid),
            lambda fan: collect_text(fan, opts, rid),
        )

    async def _sampling(
        self, req: SamplingFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        for tid in [*(req.stop_token_ids or []), *map(int, req.logit_bias or {})]:
            if not 0 <= tid < self.ctx.prompts.vocab_size:
                raise errors.InvalidRequest(
                    f"token id {tid} is not in this model's vocabulary "
                    f"(0..{self.ctx.prompts.vocab_size - 1})",
                    param="stop_token_ids" if tid in (req.stop_token_ids or []) else "logit_bias",
                )
        sampling = req.sampling(max_tokens, logprobs)
        found = one_constraint(requested(req))
        if found is not None:
            sampling.constraint = await self._check(*found)
        return sampling

    async def _check(self, param: str, c: Constraint) -> Constraint:
        """Compiled against the tokenizer here, so a bad grammar is a 400 before placement."""
        await asyncio.to_thread(self.ctx.checker.check, param, c)
        return c

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        return frozenset(self.ctx.texts.special) | frozenset(sampling.stop_token_ids)

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
        if req.n > self.ctx.settings.max_choices:
            raise errors.InvalidRequest(
                f"n is {req.n}; this server allows at most {self.ctx.settings.max_choices}",
                param="n",
                code="integer_above_max_value",
            )
        if len(prompts) > self.ctx.settings.max_prompts:
            raise errors.InvalidRequest(
                f"the batch has {len(prompts)} prompts; this server "
                f"takes at most {self.ctx.settings.max_prompts}",
                param="prompt",
                code="array_above_max_length",
            )
        subs = []
        for p, ids in enumerate(prompts):
            hashes: list[int] = list(block_hashes(ids, self.ctx.settings.block_size, salt=tenant))
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
                    model=self.ctx.prompts.model_name,
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
                self.ids.remember(sub_id)
        return subs

    async def _serve(
        self,
        request: web.Request,
        fan: Fanout,
        rid: str,
        stream: Callable[[web.StreamResponse, Fanout], Awaitable[None]],
        collect: Callable[[Fanout], Awaitable[dict[str, Any]]],
    ) -> web.StreamResponse:
        self.ctx.in_flight += 1
        try:
            await fan.start()
            if fan.stream:
                return await self._stream(request, fan, rid, stream)
            body = await until_disconnected(request, collect(fan), fan)
            return web.json_response(body, headers={"X-Request-Id": rid})
        finally:
            self.ctx.in_flight -= 1
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
            await write_quietly(resp, sse_error(exc))
        except (ConnectionResetError, ConnectionError) as exc:
            fan.disconnected(str(exc))
            log.info("request %s: client went away, cancelling", rid)
        return resp


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
    return sse(exc.body()) + sse("[DONE]")
