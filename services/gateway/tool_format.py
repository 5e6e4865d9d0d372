"""What every tool format is, and the pieces the formats share.

Its own module, below tools.py (the Hermes format, the stream parser, the table of
formats) and mistral_tools.py, so that each format can live in a file of its own without
an import cycle: both import this, and tools.py imports both.

A format names its markers: `open`, where the calls begin, and `close`, where a block of
them ends, or None when the calls run to the end of the reply. `needs_special_tokens`
says the marker is a special token, which the engine's detokenizer drops unless the
request asks it not to (SamplingParams.skip_special_tokens).
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.gateway.protocol import AssistantMessage, NamedToolChoice, Tool

ALPHANUMERIC = string.ascii_letters + string.digits

# Compact, one-line JSON as the formats show it: a small model given free whitespace
# wanders in it until max_tokens.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def random_id(length: int) -> str:
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(length))


def call_id() -> str:
    """OpenAI's shape of call id: call_ and 24 letters or digits."""
    return "call_" + random_id(24)


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


class ToolFormat(ABC):
    """One model family's way of writing tool calls: how tools and past calls render
    where the chat template cannot, how the model's calls parse, and the Lark grammar
    (llguidance's dialect) that forces a call."""

    name: ClassVar[str]
    open: ClassVar[str]  # the marker a block of calls starts with
    close: ClassVar[str | None]  # the marker it ends with; None: the end of the reply
    needs_special_tokens: ClassVar[bool] = False  # the marker is a special token

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        # The tokenizer's special tokens (text -> id): a grammar must name a special
        # marker by its id, since llguidance never matches one with literal text.
        self.special_tokens = dict(special_tokens or {})

    @abstractmethod
    def parse(self, block: str) -> list[ParsedCall] | None:
        """The calls in the text between the markers; None when it is not calls."""

    def new_id(self) -> str:
        return call_id()

    @abstractmethod
    def system_text(self, tools: list[Tool]) -> str:
        """The tools, and how to call them, for a system message."""

    @abstractmethod
    def render_calls(self, message: AssistantMessage) -> str:
        """An assistant message's text and past calls, as the model would have written them."""

    @abstractmethod
    def render_reply(self, name: str, content: str, tool_call_id: str) -> str:
        """A tool message: the result of call `tool_call_id`, of function `name`."""

    @abstractmethod
    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> str:
        """Lark: one call, or several when parallel, of the allowed tools."""

    def marker(self, text: str) -> str:
        """A Lark terminal for a marker: its token (`<[id]>`) when the model writes it as
        one special token and it reaches the parser, else the text."""
        token = self.special_tokens.get(text)
        if self.needs_special_tokens and token is not None:
            return f"<[{token}]>"
        return json.dumps(text)


def allowed(tools: list[Tool], choice: str | NamedToolChoice) -> list[Tool]:
    """The tools a call may name: the named one, or all."""
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return tools


def call_schema(tool: Tool, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """JSON schema of one call of `tool`: its name, its arguments held to its parameters
    schema (and `extra` properties, all required), compact."""
    props: dict[str, Any] = {
        "name": {"const": tool.function.name},
        "arguments": tool.function.parameters or {"type": "object"},
        **(extra or {}),
    }
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
        "x-guidance": COMPACT_JSON,
    }


def arguments(text: str) -> Any:
    """A call's arguments as JSON, or the text itself when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_of(obj: Any, new_id: str) -> ParsedCall | None:
    """One call from a parsed JSON value ({"name": ..., "arguments": {...}}, or
    "parameters" for "arguments", or arguments as JSON text); None if it is not one."""
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
    return ParsedCall(obj["name"], json.dumps(args), new_id)
