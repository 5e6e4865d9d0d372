"""Mistral's tool format (Mistral-7B-Instruct-v0.3 and later, as vLLM's mistral tool parser
reads it), in a module of its own beside the Hermes one in tools.py.

The model writes its calls after one special token, to the end of the reply:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

a JSON array (a single object is taken too, and "parameters" for "arguments"). The marker
is a special token, which the engine's detokenizer keeps only when told to
(`needs_special_tokens`). Call ids are 9 letters or digits: Mistral's chat template
refuses any other, and the ids a client sends back come from here.

Where the chat template has no tool section (the fallback), tools render into the system
message as [AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS], past calls as the model writes them
(with their ids), and a tool message as
[TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS], as Mistral's template does.
"""

from __future__ import annotations

import json

from services.gateway.protocol import AssistantMessage, NamedToolChoice, Tool
from services.gateway.tool_format import (
    ParsedCall,
    ToolFormat,
    allowed,
    arguments,
    call_of,
    call_schema,
    random_id,
)

ID_LENGTH = 9  # Mistral's template: "Tool call IDs should be alphanumeric strings with length 9!"


class MistralFormat(ToolFormat):
    """[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] to the end of the reply."""

    name = "mistral"
    open, close = "[TOOL_CALLS]", None
    needs_special_tokens = True

    def new_id(self) -> str:
        return random_id(ID_LENGTH)

    def parse(self, block: str) -> list[ParsedCall] | None:
        """Every call in the text after the marker (a model that writes the marker again
        before more calls is read too); None unless all of it is calls."""
        calls: list[ParsedCall] = []
        for part in block.split(self.open):
            if not part.strip():
                continue
            try:
                value = json.loads(part)
            except ValueError:
                return None
            for obj in value if isinstance(value, list) else [value]:
                call = call_of(obj, self.new_id())
                if call is None:
                    return None
                calls.append(call)
        return calls or None

    def system_text(self, tools: list[Tool]) -> str:
        listed = json.dumps(
            [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tools]
        )
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within [AVAILABLE_TOOLS]"
            f"[/AVAILABLE_TOOLS]:\n[AVAILABLE_TOOLS] {listed}[/AVAILABLE_TOOLS]\n\n"
            "To call functions, reply with [TOOL_CALLS] and then a JSON array of calls, "
            "each with the function's name and its arguments:\n"
            '[TOOL_CALLS] [{"name": <function-name>, "arguments": <args-json-object>}]'
        )

    def render_calls(self, message: AssistantMessage) -> str:
        calls = [
            {
                "name": c.function.name,
                "arguments": arguments(c.function.arguments),
                "id": c.id,
            }
            for c in message.tool_calls or []
        ]
        block = f"{self.open} {json.dumps(calls)}"
        return "\n".join(([message.text()] if message.text() else []) + [block])

    def render_reply(self, name: str, content: str, tool_call_id: str) -> str:
        body = json.dumps({"content": content, "call_id": tool_call_id})
        return f"[TOOL_RESULTS] {body}[/TOOL_RESULTS]"

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> str:
        """`[TOOL_CALLS] [` call (`, ` call)* `]`, each call's arguments held to its
        function's parameters schema by %json; the marker is its special token where the
        tokenizer has one."""
        tools = allowed(tools, choice)
        rules = [f"call_{i}: %json {json.dumps(call_schema(t))}" for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        calls = 'call (", " call)*' if parallel else "call"
        start = f'start: {self.marker(self.open)} " [" {calls} "]"'
        return "\n".join([start, f"call: {alternatives}", *rules])
