"""Text completion responses (POST /v1/completions), streamed or whole.

With `echo` a choice's text starts with its prompt; with echo and `logprobs` its logprobs
start with the prompt's tokens (the first one has none: nothing comes before it), scored
by the prefill instance on request. max_tokens 0 with echo scores the prompt only: the
one token the engine must produce is dropped and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.gateway.bodies import sse, text_body, text_choice
from services.gateway.logprobs import CompletionLogprobs, TokenTexts
from services.gateway.runs import Fanout, Sub, usage_of
from shared import errors
from shared.messages import FinishReason, TokenEvent


@dataclass
class TextOptions:
    model: str
    created: int
    texts: TokenTexts
    logprobs: int | None
    echo: bool
    echo_texts: list[str]  # per prompt: what echo prepends
    score_only: bool  # max_tokens 0: the prompt, nothing generated
    stop_ids: frozenset[int]
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far in every chunk (vLLM's extension)


@dataclass
class TextChoice:
    sub: Sub
    opts: TextOptions
    started: bool = False
    text: list[str] = field(default_factory=list)
    lps: CompletionLogprobs | None = None
    all_lps: dict[str, list[Any]] = field(default_factory=dict)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.opts.logprobs is not None:
            self.lps = CompletionLogprobs(self.opts.texts, self.opts.logprobs)

    def step(self, event: TokenEvent) -> tuple[str, dict[str, Any] | None]:
        """This event's text and logprobs."""
        parts = []
        if not self.started:
            self.started = True
            if self.opts.echo:
                parts.append(self._echo(event))
        if not self.opts.score_only:
            parts.append(event.text)
            if self.lps is not None:
                lps = list(event.logprobs or [])
                if (
                    event.finish_reason == FinishReason.STOP
                    and lps
                    and lps[-1].token_id in self.opts.stop_ids
                ):
                    lps.pop()  # the end token is not part of the text
                self.lps.add(lps)
        if event.finish_reason is not None:
            self.finish_reason = "length" if self.opts.score_only else event.finish_reason.value
        text = "".join(parts)
        self.text.append(text)
        return text, self._take()

    def _echo(self, event: TokenEvent) -> str:
        prompt = self.sub.gen.prompt_token_ids
        echo = self.opts.echo_texts[self.sub.prompt_index]
        if self.lps is not None:
            self.lps.add_unscored(prompt[0])
            self.lps.add(event.prompt_logprobs or [])
        return echo

    def _take(self) -> dict[str, Any] | None:
        if self.lps is None:
            return None
        got = self.lps.take()
        for key, values in got.items():
            self.all_lps.setdefault(key, []).extend(values)
        return got

    def body(self) -> dict[str, Any]:
        lps = None
        if self.lps is not None:
            lps = {
                k: self.all_lps.get(k, [])
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            }
        return text_choice(self.sub.index, "".join(self.text), lps, self.finish_reason)


def _error(event: TokenEvent) -> errors.HalfmoonError:
    assert event.error is not None
    return errors.from_code(event.error.code, event.error.message, status=event.error.status)


async def collect_text(fan: Fanout, opts: TextOptions, request_id: str) -> dict[str, Any]:
    choices = {s.index: TextChoice(s, opts) for s in fan.subs}
    async for sub, event in fan.events():
        if event.error is not None:
            raise _error(event)
        choices[sub.index].step(event)
    ordered = [choices[i].body() for i in sorted(choices)]
    return text_body(
        request_id,
        opts.model,
        opts.created,
        ordered,
        usage_of(fan.subs, counted=not opts.score_only),
    )


async def stream_text(
    resp: web.StreamResponse, fan: Fanout, opts: TextOptions, request_id: str
) -> None:
    choices = {s.index: TextChoice(s, opts) for s in fan.subs}
    model, created = opts.model, opts.created
    async for sub, event in fan.events():
        if event.error is not None:
            await resp.write(sse(_error(event).body()))
            break
        choice = choices[sub.index]
        text, lps = choice.step(event)
        if text or lps and lps["tokens"] or choice.finish_reason or len(choice.text) == 1:
            usage = (
                usage_of(fan.subs, counted=not opts.score_only) if opts.continuous_usage else None
            )
            await resp.write(
                sse(
                    text_body(
                        request_id,
                        model,
                        created,
                        [text_choice(sub.index, text, lps, choice.finish_reason)],
                        usage,
                        chunk=True,
                    )
                )
            )
    else:
        if opts.include_usage:
            usage = usage_of(fan.subs, counted=not opts.score_only)
            await resp.write(sse(text_body(request_id, model, created, [], usage, chunk=True)))
    await resp.write(sse("[DONE]"))
