"""Response bodies in OpenAI's exact shapes (chat, chat chunks, text completions, models),
and the SSE framing."""

from __future__ import annotations

import json
import time
from typing import Any

from shared.messages import Usage


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_body(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage: Usage | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(usage),
    }


def chat_choice(
    index: int,
    content: str | None,
    tool_calls: list[dict[str, Any]] | None,
    finish_reason: str | None,
    logprobs: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    usage: Usage | None = None,
    with_choice: bool = True,
    index: int = 0,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    if with_choice:
        body["choices"] = [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason,
            }
        ]
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def text_body(
    request_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: Usage | None,
    chunk: bool = False,
) -> dict[str, Any]:
    """A text completion, or (chunk) one piece of its stream: chunks carry usage only in
    the last one, with include_usage."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if not chunk or usage is not None:
        body["usage"] = usage_body(usage)
    return body


def text_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def model_card(model: str, created: float, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": int(created),
        "owned_by": "halfmoon",
        "max_model_len": max_model_len,
    }


def models_body(model: str, created: float, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_model_len)]}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def now_s() -> int:
    return int(time.time())
