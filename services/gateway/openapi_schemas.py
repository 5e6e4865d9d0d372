"""What the request schemas say beyond pydantic's: this server's limits and the rules
between fields, so the description promises exactly what the gateway accepts (the e2e
fuzzing sends what it allows and expects a 2xx, and what it forbids and expects a 4xx).

- limits from the settings: the served model, messages, max_tokens, n, prompts per batch;
- token ids within the vocabulary (prompts, stop_token_ids, logit_bias, detokenize);
- rules across fields, as if/then: top_logprobs needs logprobs; tool_choice required needs
  tools; max_tokens 0 needs echo; one structured-output constraint per request;
- what a JSON schema cannot check is described narrowly: a regex has format `regex`, a
  grammar is shown as its simplest form (a choice of literals), and a named tool_choice is
  left to the operation's description (the schema cannot say "one of tools").
"""

from __future__ import annotations

from typing import Any

from services.gateway.args import GatewaySettings

_NON_BLANK = {"type": "string", "pattern": "\\S"}
NON_BLANK_MESSAGE = {
    "type": "object",
    "required": ["content"],
    "description": "at least one message has some text",
    "properties": {
        "content": {
            "anyOf": [
                _NON_BLANK,
                {
                    "type": "array",
                    "contains": {
                        "type": "object",
                        "required": ["text"],
                        "properties": {"text": _NON_BLANK},
                    },
                },
            ]
        }
    },
}
# Lark grammars the description can check: a choice of string literals. The gateway takes
# any grammar llguidance compiles (README, "Structured output").
SIMPLE_GRAMMAR = r'^start: "[a-z0-9 ]*"( \| "[a-z0-9 ]*")*$'
CONSTRAINT_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "response_format",
)


def _given(name: str) -> dict[str, Any]:
    """`name` is present and not null (null means absent)."""
    cond: dict[str, Any] = {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
    if name == "response_format":
        cond["properties"][name] = {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["json_object", "json_schema"]}},
        }
    if name == "tool_choice":
        cond["properties"][name] = {"const": "required"}
    return cond


def _branch(prop: dict[str, Any], kind: str) -> dict[str, Any]:
    """The `kind` branch of an optional field's anyOf (or the field itself)."""
    branches: list[dict[str, Any]] = prop.get("anyOf", [])
    for b in branches:
        if b.get("type") == kind:
            return b
    return prop


def _only(prop: dict[str, Any], kind: str) -> None:
    """Keep the `kind` branch of an optional field (and null)."""
    if "anyOf" in prop:
        prop["anyOf"] = [b for b in prop["anyOf"] if b.get("type") in (kind, "null")]


def _token_ids(items: dict[str, Any], vocab: int) -> None:
    items.update(minimum=0, maximum=vocab - 1)


def _common(
    schema: dict[str, Any], settings: GatewaySettings, vocab: int, fields: tuple[str, ...]
) -> None:
    props = schema["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props and settings.max_output_tokens:
            _branch(props[name], "integer")["maximum"] = settings.max_output_tokens
    _branch(props["n"], "integer")["maximum"] = settings.max_choices
    _token_ids(_branch(props["stop_token_ids"], "array")["items"], vocab)
    bias = _branch(props["logit_bias"], "object")
    bias["propertyNames"] = {"pattern": f"^0*({_below(vocab)})$"}
    bias["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
    _only(props["guided_json"], "object")
    regex = _branch(props["guided_regex"], "string")
    regex["format"] = "regex"
    props["guided_regex"].pop("format", None)
    _branch(props["guided_grammar"], "string")["pattern"] = SIMPLE_GRAMMAR
    rules = [
        {"if": _given(f), "then": {"not": {"anyOf": [_given(g) for g in fields if g != f]}}}
        for f in fields
    ]
    schema.setdefault("allOf", []).extend(rules)


def _structured_outputs(schemas: dict[str, Any]) -> None:
    """Exactly one constraint given (null, as everywhere, means absent)."""
    so = schemas["StructuredOutputs"]
    props = so["properties"]
    for prop in props.values():
        prop.pop("default", None)
    so["oneOf"] = [_given(name) for name in props]
    props["json"]["anyOf"] = [
        b for b in props["json"]["anyOf"] if b.get("type") in ("object", "null")
    ]
    props["regex"].pop("format", None)
    props["regex"]["anyOf"][0]["format"] = "regex"
    props["grammar"]["anyOf"][0]["pattern"] = SIMPLE_GRAMMAR


def _below(n: int) -> str:
    """A regex for the decimal integers 0 .. n-1, without leading zeros."""
    s = str(n - 1)
    parts = ["0"] + ["[1-9]" + (f"[0-9]{{{k}}}" if k else "") for k in range(len(s) - 1)]
    for i, d in enumerate(s):  # the numbers of len(s) digits that are at most s
        low, rest = (1 if i == 0 else 0), len(s) - i - 1
        if int(d) > low:
            parts.append(s[:i] + f"[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    parts.append(s)
    return "|".join(parts)


def refine(schemas: dict[str, Any], model_name: str, settings: GatewaySettings, vocab: int) -> None:
    chat = schemas["ChatCompletionRequest"]
    props = chat["properties"]
    props["model"]["enum"] = [model_name]  # any other name is a 404
    props["messages"]["contains"] = NON_BLANK_MESSAGE  # all-blank messages are a 400
    if settings.max_messages:
        props["messages"]["maxItems"] = settings.max_messages
    props["tool_choice"]["anyOf"] = [b for b in props["tool_choice"]["anyOf"] if "$ref" not in b]
    _common(chat, settings, vocab, (*CONSTRAINT_FIELDS, "tool_choice"))
    chat["allOf"] += [
        {
            "if": _given("top_logprobs"),
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        },
        {
            "if": _given("tool_choice"),
            "then": {
                "required": ["tools"],
                "properties": {"tools": {"type": "array", "minItems": 1}},
            },
        },
    ]
    text = schemas["CompletionRequest"]
    props = text["properties"]
    props["model"]["enum"] = [model_name]
    for b in props["prompt"]["anyOf"]:
        if b.get("type") == "array":
            inner = b["items"]
            if inner.get("type") == "array":
                _token_ids(inner["items"], vocab)
                b["maxItems"] = settings.max_prompts
            elif inner.get("type") == "integer":
                _token_ids(inner, vocab)
            else:
                b["maxItems"] = settings.max_prompts
    _common(text, settings, vocab, CONSTRAINT_FIELDS)
    text["allOf"].append(
        {
            "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
            "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
        }
    )
    _structured_outputs(schemas)
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        _branch(schemas[name]["properties"]["model"], "string")["enum"] = [model_name]
    tok = schemas["TokenizeRequest"]
    tok["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
    for key in ("prompt", "messages"):  # the other one is absent, not null
        _only(tok["properties"][key], "string" if key == "prompt" else "array")
    _token_ids(schemas["DetokenizeRequest"]["properties"]["tokens"]["items"], vocab)
