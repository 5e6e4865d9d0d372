"""OpenAI chat-completions request validation and response bodies."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from shared import errors
from shared.messages import SamplingParams, Usage


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "n", "seed")


def _stop_schema(schema: dict[str, Any]) -> None:
    """Show in the JSON schema what `_stop` checks: at most 4 strings, none empty."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch.update(maxItems=4, items={"type": "string", "minLength": 1})


class ChatCompletionRequest(BaseModel):
    # strict: "5" is not a number here, as with OpenAI. Unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension, as in vLLM
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = Field(None, json_schema_extra=_stop_schema)
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension: benchmarks need fixed output lengths
    ttft_slo_ms: float | None = Field(None, gt=0)  # extension: this request's SLOs
    tbt_slo_ms: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        # JSON has one number type: 8.0 is the integer 8 (JSON Schema agrees), but strict
        # mode would refuse it. Strings stay refused.
        if isinstance(data, dict):
            fixed = {k: int(v) for k in _INT_FIELDS
                     if isinstance(v := data.get(k), float) and v.is_integer()}
            if fixed:
                data = {**data, **fixed}
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling(self, max_tokens: int) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=max_tokens, stop=stops, seed=self.seed,
                              ignore_eos=self.ignore_eos)


def parse_request(body: Any) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise errors.InvalidRequest("request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise errors.InvalidRequest(f"{param}: {first['msg']}" if param else first["msg"],
                                    param=param) from None


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def completion_body(request_id: str, model: str, created: int, text: str,
                    finish_reason: str | None, usage: Usage | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_body(usage),
    }


def chunk_body(request_id: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, usage: Usage | None = None,
               with_choice: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                            "created": created, "model": model, "choices": []}
    if with_choice:
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": finish_reason}]
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def models_body(model: str, created: float) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model",
                                        "created": int(created), "owned_by": "halfmoon"}]}


def now_s() -> int:
    return int(time.time())
