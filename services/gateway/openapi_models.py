"""Response bodies as the OpenAPI description shows them (documentation only: bodies.py,
chat.py and completions.py build the real ones; the e2e fuzzing checks they agree)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


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
    prompt_tokens: int  # each prompt once, whatever n is
    completion_tokens: int  # every choice's
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry]
    refusal: None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is tool calls only
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessageOut
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage | None


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None  # with the choice's first token
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]  # empty in the last chunk with include_usage
    usage: CompletionUsage | None = None


class TextLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token (with echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """A text completion, or (stream=true) one chunk of one: chunks have no usage except
    the last, with include_usage (and no choices then)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


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


class RoleSwitchAccepted(BaseModel):
    switch_id: str
    instance_id: str
    from_role: Literal["prefill", "decode"]
    to_role: Literal["prefill", "decode"]
    status: Literal["draining"]


RESPONSE_MODELS: list[type[BaseModel]] = [
    ErrorResponse,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelCard,
    ModelList,
    TokenizeResponse,
    DetokenizeResponse,
    Version,
    Health,
    AdminState,
    AdminRequest,
    RoleSwitchAccepted,
]
