"""Request validation shared by chat and text completions, and the chat request itself.

Every field a request may carry is declared here (or in completion_protocol.py): an
unknown one is a 400 that names it, as OpenAI answers, and a known OpenAI parameter that
Halfmoon does not implement is a 400 that says so. Nothing is accepted and then ignored.
`null` for an optional field means its default, as most clients send it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from services.gateway.validation import Integral, Strict, drop_nulls, integral_fields
from shared import errors
from shared.messages import COUNT_LIMIT, SamplingParams

# OpenAI parameters Halfmoon does not implement: refused by name, with why.
UNSUPPORTED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "store": "stored completions are not supported",
    "metadata": "stored completions (and their metadata) are not supported",
    "service_tier": "service tiers are not supported",
    "reasoning_effort": "this model does not reason; reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "suffix": "suffix (insertion) is not supported",
    "prompt_cache_key": "prompt_cache_key is not supported (the prefix cache needs no key)",
    "safety_identifier": "safety_identifier is not supported",
}
_ALLOWED_DEFAULTS: dict[str, list[Any]] = {
    "modalities": [["text"]],
    "store": [False],
    "service_tier": ["auto", "default"],
}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


def _stop_schema(schema: dict[str, Any]) -> None:
    """Show in the JSON schema what `_stop` checks: at most 4 strings, none empty."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch.update(maxItems=4, items={"type": "string", "minLength": 1})


SCHEMA_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=SCHEMA_NAME)
    description: str | None = None
    # Any JSON schema the grammar library compiles (checked before placement).
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


FORMAT_TYPES = ("text", "json_object", "json_schema")
ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, json_schema_extra={"format": "regex"})
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


INT_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "top_k",
    "n",
    "seed",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "best_of",
    "num_speculative_tokens",
)
SEED_RANGE = 2**63


class SamplingFields(Strict):
    """What chat and text completions share: the model, streaming, sampling and the
    structured-output extensions."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # Extension, as in vLLM: 0 and -1 mean off. Bounded as the bus's counts are.
    top_k: int = Field(0, ge=-1, lt=COUNT_LIMIT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # extension
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = Field(None, json_schema_extra=_stop_schema)
    stop_token_ids: list[Integral] | None = Field(None, max_length=64)  # extension
    seed: int | None = Field(None, ge=-SEED_RANGE, lt=SEED_RANGE)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # extension
    # Token id (as a string, as OpenAI has it) -> bias added to its logit.
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    min_tokens: int = Field(0, ge=0, lt=COUNT_LIMIT)  # extension
    user: str | None = None  # a caller's tag: logged with the request id, never used
    ignore_eos: bool = False  # extension: benchmarks need fixed output lengths
    ttft_slo_ms: float | None = Field(None, gt=0)  # extension: this request's SLOs
    # Extension: prompt-lookup drafts per decode step (0: none; unset: the deployment's).
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)
    tbt_slo_ms: float | None = Field(None, gt=0)
    response_format: ResponseFormat | None = None
    # vLLM-style structured-output extensions (one constraint per request in all).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, json_schema_extra={"format": "regex"})
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any) -> Any:
        data = integral_fields(drop_nulls(data), INT_FIELDS)
        if isinstance(data, dict):
            for name in data:
                if name in UNSUPPORTED and data[name] not in _ALLOWED_DEFAULTS.get(name, []):
                    raise errors.InvalidRequest(
                        f"{name}: {UNSUPPORTED[name]}", param=name, code="unsupported_parameter"
                    )
            data = {k: v for k, v in data.items() if k not in UNSUPPORTED}
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not re.fullmatch("[0-9]{1,30}", key):
                raise ValueError(f"logit_bias keys are token ids; {key!r} is not one")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are from -100 to 100; {key} has {bias}")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling(self, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
        """The bus's sampling parameters (the constraint is added by structured.py)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stops(),
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs,
            num_speculative_tokens=self.num_speculative_tokens,
        )


# -- chat --------------------------------------------------------------------------------
class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(Strict):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageBase(Strict):
    content: str | list[TextPart] | None = None
    name: str | None = None  # passed to the chat template, which may render it
    tool_calls: None = None  # only assistant messages have them
    tool_call_id: None = None  # only tool messages have one

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SystemMessage(MessageBase):
    role: Literal["system", "developer"]
    content: str | list[TextPart]


class UserMessage(MessageBase):
    role: Literal["user"]
    content: str | list[TextPart]


class AssistantMessage(MessageBase):
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)  # type: ignore[assignment]


class ToolMessage(MessageBase):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str  # type: ignore[assignment]  # which call this answers


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionDef(Strict):
    name: str = Field(pattern=SCHEMA_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments
    strict: bool | None = None  # arguments follow the schema when the grammar applies


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str = Field(pattern=SCHEMA_NAME)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise errors.InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        # "auto" with no tools is plain text (nothing to call; some clients always send it).
        if choice not in (None, "none", "auto") and not self.tools:
            raise errors.InvalidRequest(
                "tool_choice required or a named tool needs tools", param="tool_choice"
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise errors.InvalidRequest(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """none without tools; auto with tools unless told otherwise (OpenAI's defaults)."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"


Body = TypeVar("Body", bound=Strict)


def parse_body(model: type[Body], body: Any) -> Body:
    """Validate a request body, or raise a 400 naming the first problem."""
    if not isinstance(body, dict):
        raise errors.InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # Of a union's failed branches, the one that got furthest names the real problem
        # (an image part: not "content is not a string", but "type should be 'text'").
        found = exc.errors()
        first = max(found, key=lambda e: (e["loc"][:1] == found[0]["loc"][:1], len(e["loc"])))
        param = ".".join(str(p) for p in _field_path(first["loc"])) or None
        if first["type"] == "extra_forbidden":
            raise errors.InvalidRequest(
                f"Unrecognized request argument supplied: {param}",
                param=param,
                code="unknown_parameter",
            ) from None
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, errors.HalfmoonError):
            raise cause from None
        raise errors.InvalidRequest(
            f"{param}: {first['msg']}" if param else first["msg"], param=param
        ) from None


_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|\w+\[.*\]|function-\w+.*)$")


def _field_path(loc: tuple[Any, ...]) -> list[Any]:
    """pydantic's error location without its union-branch tags (`str`, `list[int]`, a
    message's role, a response_format's type): the parameter as the client wrote it."""
    out: list[Any] = []
    for i, part in enumerate(loc):
        tag = isinstance(part, str) and (
            bool(_TAG.match(part))
            or (i == 2 and loc[0] in ("messages",) and part in ROLES)
            or (i == 1 and loc[0] == "response_format" and part in FORMAT_TYPES)
        )
        if not tag:
            out.append(part)
    return out


def parse_request(body: Any) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, body)
