"""Tool calling: how tools reach the prompt, and how the model's calls come back out.

A *tool format* (tool_format.ToolFormat) is one small class per model family: it renders
tools and past calls when the chat template cannot, parses the model's calls (whole, or
as a stream of deltas, with StreamingCalls), and gives the Lark grammar that forces a call
(tool_choice required or named). Two are known: HermesFormat here, and MistralFormat
(mistral_tools.py: `[TOOL_CALLS] [...]` to the end of the reply, its marker a special
token). FORMATS maps a name to its class; `format_for` picks one for a model, by its
config.json's model_type, unless --tool-format names one.

Where the chat template has a tool section (it mentions `tools`), the tools and the
assistant's past calls go to the template as transformers expects them. Where it has none
(the default model, SmolLM2), the fallback renders them into the system message, in the
format the parser reads (documented in docs/reference.md, "Tool calling"). Hermes':

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
from collections.abc import Mapping

from services.gateway.mistral_tools import MistralFormat
from services.gateway.protocol import AssistantMessage, NamedToolChoice, Tool
from services.gateway.tool_format import (
    ParsedCall,
    ToolFormat,
    allowed,
    arguments,
    call_of,
    call_schema,
)


class HermesFormat(ToolFormat):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Hermes and Qwen models
    write them; also the fallback for templates without a tool section."""

    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"

    def parse(self, block: str) -> list[ParsedCall] | None:
        try:
            call = call_of(json.loads(block), self.new_id())
        except ValueError:
            return None
        return None if call is None else [call]

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
            + json.dumps({"name": c.function.name, "arguments": arguments(c.function.arguments)})
            + f"\n{self.close}"
            for c in message.tool_calls or []
        ]
        return "\n".join(([message.text()] if message.text() else []) + blocks)

    def render_reply(self, name: str, content: str, tool_call_id: str) -> str:
        return (
            "<tool_response>\n"
            + json.dumps({"name": name, "content": content})
            + "\n</tool_response>"
        )

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> str:
        """Lark (llguidance's dialect): one call, or one or more, of the allowed tools, each
        function's arguments held to its parameters schema by %json."""
        tools = allowed(tools, choice)
        rules = [
            f'call_{i}: "{self.open}\\n" %json {json.dumps(call_schema(t))} "\\n{self.close}"'
            for i, t in enumerate(tools)
        ]
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, f"call: {alternatives}", *rules])


class StreamingCalls:
    """Splits a stream of text into content deltas and completed calls: text that might be
    the start of a call is held until it is one, or cannot be. A format without a close
    marker holds everything from its open marker to the end, and parses it at finish().
    A block that does not parse comes back as content."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
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
            end = -1 if close is None else self.buffer.find(close, start)
            if end < 0 and not final:
                self.buffer = self.buffer[start:]
                break
            if end < 0:  # to the end of the reply
                block, block_end = self.buffer[start + len(open_) :], len(self.buffer)
            else:
                block, block_end = self.buffer[start + len(open_) : end], end + len(close or "")
            calls = self.fmt.parse(block.strip())
            if calls is None:
                content.append(self.buffer[start:block_end])
            else:
                calls = calls if self.parallel else calls[: 0 if self.calls else 1]
                self.calls += calls
                new += calls
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


FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "mistral": MistralFormat}
# Model families (config.json's model_type) and the format their models write. Phi-3 has
# no tool format of its own: Hermes', which the fallback teaches it.
BY_MODEL_TYPE = {
    "llama": "hermes",
    "qwen2": "hermes",
    "qwen3": "hermes",
    "phi3": "hermes",
    "mistral": "mistral",
}


def skip_special_tokens(fmt: ToolFormat | None) -> bool:
    """Whether the engine may drop special tokens from a reply that `fmt` parses (None:
    tools off): not when the format's marker is one."""
    return fmt is None or not fmt.needs_special_tokens


def format_for(
    model_type: str, override: str = "", special_tokens: Mapping[str, int] | None = None
) -> ToolFormat:
    """The format for a model family, or the one `override` names (ValueError if unknown);
    `special_tokens` (text -> id) are the tokenizer's, for the grammar's markers."""
    name = override or BY_MODEL_TYPE.get(model_type, "hermes")
    if name not in FORMATS:
        raise ValueError(f"unknown tool format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name](special_tokens)
