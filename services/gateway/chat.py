"""Chat completion responses, streamed or whole, from the merged events of the choices.

Each choice turns its token events into content, tool calls and logprobs. In a stream the
role goes out with a choice's first token (with its text, maybe none yet), never before:
a client that times the first chunk times the first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.gateway.bodies import chat_body, chat_choice, chunk_body, sse
from services.gateway.logprobs import TokenTexts, chat_entries
from services.gateway.runs import Fanout, usage_of
from services.gateway.tool_format import ToolFormat
from services.gateway.tools import StreamingCalls
from shared import errors
from shared.messages import FinishReason, TokenEvent


@dataclass
class ChatOptions:
    model: str
    created: int
    texts: TokenTexts
    logprobs: int | None  # None: none; k: each token's and the top k
    stop_ids: frozenset[int]  # a final stop token has no text and no logprob entry
    tool_format: ToolFormat | None  # None: tools off (none given, or tool_choice none)
    parallel_tool_calls: bool = True
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far in every chunk (vLLM's extension)


@dataclass
class ChatChoice:
    index: int
    opts: ChatOptions
    calls: StreamingCalls | None = None
    role_sent: bool = False
    content: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.opts.tool_format is not None:
            self.calls = StreamingCalls(self.opts.tool_format, self.opts.parallel_tool_calls)

    def step(self, event: TokenEvent) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """This event's delta and logprob entries (None when not asked for)."""
        text, new_calls = (
            self.calls.feed(event.text) if self.calls is not None else (event.text, [])
        )
        if event.finish_reason is not None and self.calls is not None:
            more, last = self.calls.finish()
            text, new_calls = text + more, new_calls + last
        delta: dict[str, Any] = {}
        if event.token_ids and not self.role_sent:
            delta["role"] = "assistant"
            self.role_sent = True
            delta["content"] = text
        elif text:
            delta["content"] = text
        self.content.append(text)
        if new_calls:
            first = len(self.tool_calls)
            bodies = [c.body() for c in new_calls]
            self.tool_calls += bodies
            delta["tool_calls"] = [{"index": first + i, **b} for i, b in enumerate(bodies)]
        entries = self._logprobs(event)
        if event.finish_reason is not None:
            self.finish_reason = self._finish(event.finish_reason)
        return delta, entries

    def _logprobs(self, event: TokenEvent) -> list[dict[str, Any]] | None:
        if self.opts.logprobs is None:
            return None
        lps = list(event.logprobs or [])
        if (
            event.finish_reason == FinishReason.STOP
            and lps
            and lps[-1].token_id in self.opts.stop_ids
        ):
            lps.pop()  # the end-of-turn token is not part of the answer
        entries = chat_entries(self.opts.texts, lps, self.opts.logprobs)
        self.logprobs += entries
        return entries

    def _finish(self, reason: FinishReason) -> str:
        if reason == FinishReason.STOP and self.tool_calls:
            return "tool_calls"
        return reason.value

    def body(self) -> dict[str, Any]:
        text = "".join(self.content)
        content = (text or None) if self.tool_calls else text
        return chat_choice(
            self.index,
            content,
            self.tool_calls or None,
            self.finish_reason,
            self.logprobs if self.opts.logprobs is not None else None,
        )


def _raise_worker_error(event: TokenEvent) -> None:
    assert event.error is not None
    raise errors.from_code(event.error.code, event.error.message, status=event.error.status)


async def collect_chat(fan: Fanout, opts: ChatOptions, request_id: str) -> dict[str, Any]:
    choices = {s.index: ChatChoice(s.index, opts) for s in fan.subs}
    async for sub, event in fan.events():
        if event.error is not None:
            _raise_worker_error(event)
        choices[sub.index].step(event)
    ordered = [choices[i].body() for i in sorted(choices)]
    return chat_body(request_id, opts.model, opts.created, ordered, usage_of(fan.subs))


async def stream_chat(
    resp: web.StreamResponse, fan: Fanout, opts: ChatOptions, request_id: str
) -> None:
    """Chunks until every choice has finished, then usage (if asked) and [DONE]. A
    worker's error ends the stream with an error event."""
    choices = {s.index: ChatChoice(s.index, opts) for s in fan.subs}
    model, created = opts.model, opts.created
    async for sub, event in fan.events():
        if event.error is not None:
            err = errors.from_code(event.error.code, event.error.message, status=event.error.status)
            await resp.write(sse(err.body()))
            break
        choice = choices[sub.index]
        delta, entries = choice.step(event)
        usage = usage_of(fan.subs) if opts.continuous_usage else None
        if delta or entries:
            await resp.write(
                sse(
                    chunk_body(
                        request_id,
                        model,
                        created,
                        delta,
                        index=sub.index,
                        logprobs=entries,
                        usage=usage,
                    )
                )
            )
        if choice.finish_reason is not None:
            await resp.write(
                sse(
                    chunk_body(
                        request_id,
                        model,
                        created,
                        {},
                        choice.finish_reason,
                        index=sub.index,
                        usage=usage,
                    )
                )
            )
    else:
        if opts.include_usage:
            await resp.write(
                sse(
                    chunk_body(
                        request_id, model, created, {}, usage=usage_of(fan.subs), with_choice=False
                    )
                )
            )
    await resp.write(sse("[DONE]"))
