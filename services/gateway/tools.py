"""Tool calling: how tools reach the prompt, and how the model's calls come back out.

A *tool format* is one small class per model family: it renders tools and past calls
when the chat template cannot, parses the model's calls (whole, or as a stream of
deltas), and gives the Lark grammar that forces a call (tool_choice required or named).
FORMATS maps a name to its class; `format_for` picks one for a model.

Where the chat template has a tool section (it mentions `tools`), the tools and the
assistant's past calls go to the template as transformers expects them. Where it has none
(the default model, SmolLM2), the fallback renders them into the system message, in the
format the parser reads (documented in README.md, "Tool calling"):

    # Tools
    You may call one or more functions ... within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
    </tools>
    For each function call, return a json object ... within <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

An assistant message's past calls render as those <tool_call> blocks, and a tool message
as <tool_response>{"name": ..., "content": ...}</tool_response>, the call it answers found
by its tool_call_id.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from services.gateway.protocol import AssistantMessage, NamedToolChoice, Tool

_ALPHABET = string.ascii_letters + string.digits


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class HermesFormat:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Hermes and Qwen models
    write them; also the fallback for templates without a tool section."""

    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"

    def system_text(self, tools: list[Tool]) -> str:
        lines = "\n".join(
            json.dumps(t.model_dump(mode="json", by_alias=True, exclude_none=True)) for t in tools
        )
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML "
            f"tags:\n<tools>\n{lines}\n</tools>\n\nFor each function call, return a json "
            "object with function name and arguments within <tool_call></tool_call> XML "
            'tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>"
        )

    def render_calls(self, message: AssistantMessage) -> str:
        blocks = [
            f"{self.open}\n"
            + json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)})
            + f"\n{self.close}"
            for c in message.tool_calls or []
        ]
        return "\n".join(([message.text()] if message.text() else []) + blocks)

    def render_reply(self, name: str, content: str) -> str:
        return (
            "<tool_response>\n"
            + json.dumps({"name": name, "content": content})
            + "\n</tool_response>"
        )

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> str:
        """Lark (llguidance's dialect): one call, or one or more, of the allowed tools, each
        function's arguments held to its parameters schema by %json."""
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == choice.function.name]
        rules = []
        for i, t in enumerate(tools):
            schema = {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
                # Compact, one-line JSON as the format shows it: a small model given free
                # whitespace wanders in it until max_tokens.
                "x-guidance": {
                    "whitespace_flexible": False,
                    "item_separator": ", ",
                    "key_separator": ": ",
                },
            }
            rules.append(f'call_{i}: "{self.open}\\n" %json {json.dumps(schema)} "\\n{self.close}"')
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, f"call: {alternatives}", *rules])


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(block: str) -> ParsedCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args))


class StreamingCalls:
    """Splits a stream of text into content deltas and completed calls: text that might be
    the start of a call is held until it is one, or cannot be."""

    def __init__(self, fmt: HermesFormat, parallel: bool = True) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.buffer = ""
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[ParsedCall]]:
        content: list[str] = []
        new: list[ParsedCall] = []
        open_, close = self.fmt.open, self.fmt.close
        while self.buffer:
            start = self.buffer.find(open_)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, open_)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content.append(self.buffer[:start])
            end = self.buffer.find(close, start)
            if end < 0 and not final:
                self.buffer = self.buffer[start:]
                break
            block_end = len(self.buffer) if end < 0 else end + len(close)
            call = _call(self.buffer[start + len(open_) : end if end >= 0 else None].strip())
            if call is None or (self.calls and not self.parallel):
                content.append(self.buffer[start:block_end] if call is None else "")
            else:
                self.calls.append(call)
                new.append(call)
            self.buffer = self.buffer[block_end:]
        text = "".join(content)
        if self.calls:  # around calls, whitespace is layout, not content
            text = text.strip() if final or not text.strip() else text
        return text, new


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


FORMATS: dict[str, type[HermesFormat]] = {"hermes": HermesFormat}
# Model families (config.json's model_type) and the format their models write.
BY_MODEL_TYPE = {"llama": "hermes", "qwen2": "hermes", "qwen3": "hermes", "mistral": "hermes"}


def format_for(model_type: str, override: str = "") -> HermesFormat:
    name = override or BY_MODEL_TYPE.get(model_type, "hermes")
    if name not in FORMATS:
        raise ValueError(f"unknown tool format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]()
