"""Chat template and tokenization, with the context-length checks that go with them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from transformers import AutoTokenizer

from services.gateway.completion_protocol import DEFAULT_MAX_TOKENS, CompletionRequest
from services.gateway.protocol import AssistantMessage, ChatCompletionRequest, ChatMessage
from services.gateway.tool_format import ToolFormat
from services.gateway.tools import format_for
from shared import errors
from shared.model_context import trained_length

# The tools as transformers' chat templates take them (each a JSON schema, here).
TemplateTools = list[dict[Any, Any] | Callable[..., Any]]


class PromptBuilder:
    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        default_max_tokens: int,
        *,
        max_model_len: int = 0,
        max_messages: int = 0,
        max_prompt_tokens: int = 0,
        max_output_tokens: int = 0,
        tool_format: str = "",
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        config = json.loads((model_dir / "config.json").read_text())
        # As served (--max-model-len, --rope-scaling), which the engines load with too.
        self.max_model_len = max_model_len or trained_length(config)
        self.vocab_size = int(config.get("vocab_size", len(self.tokenizer)))
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        # The most characters one token covers: text longer than (token limit x this)
        # cannot fit, and is refused without tokenizing it (megabytes of text would hold
        # the event loop, and every stream on it, for seconds).
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) + 1
        # Operator limits (0: none beyond the model's context).
        self.max_messages = max_messages
        self.max_prompt_tokens = max_prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.tool_format: ToolFormat = format_for(
            str(config.get("model_type", "")), tool_format, special_tokens(self.tokenizer)
        )
        template = self.tokenizer.chat_template
        # A template that mentions tools renders them itself; others get the fallback.
        self.template_renders_tools = isinstance(template, str) and "tools" in template

    @property
    def token_limit(self) -> int:
        return min(n for n in (self.max_prompt_tokens, self.max_model_len) if n)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise errors.ModelNotFound(
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
            )

    # -- chat ------------------------------------------------------------------------------
    def build(self, chat: ChatCompletionRequest) -> tuple[list[int], int]:
        """Prompt token ids and the effective max_tokens, or a 4xx error."""
        self.check_model(chat.model)
        if self.max_messages and len(chat.messages) > self.max_messages:
            raise errors.InvalidRequest(
                f"messages has {len(chat.messages)} entries; this server takes at most "
                f"{self.max_messages}.",
                param="messages",
                code="array_above_max_length",
            )
        self._check_max_tokens(chat.requested_max_tokens())
        if not any(m.text().strip() or m.tool_calls for m in chat.messages):
            raise errors.InvalidRequest("messages are all empty", param="messages")
        messages, tools = self.render_messages(chat)
        self.check_chars(sum(len(str(m.get("content") or "")) for m in messages), "messages")
        ids = self.tokenize(messages, tools)
        return ids, self._max_tokens(
            len(ids), chat.requested_max_tokens(), "messages", self.default_max_tokens
        )

    def reply_format(self, chat: ChatCompletionRequest) -> ToolFormat | None:
        """The tool format the reply is parsed with; None when tools are off (none
        given, or tool_choice none)."""
        return self.tool_format if chat.effective_tool_choice() != "none" else None

    def render_messages(
        self, chat: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]], TemplateTools | None]:
        """The template's messages (and tools, when it renders them itself)."""
        show_tools = chat.effective_tool_choice() != "none" and bool(chat.tools)
        if self.template_renders_tools:
            tools: TemplateTools = [
                t.model_dump(mode="json", exclude_none=True) for t in chat.tools or []
            ]
            return [_hf_message(m) for m in chat.messages], (tools if show_tools else None)
        fmt = self.tool_format
        names = {c.id: c.function.name for m in chat.messages for c in m.tool_calls or []}
        messages: list[dict[str, Any]] = []
        for m in chat.messages:
            if m.role == "tool":
                call = m.tool_call_id or ""
                text = fmt.render_reply(names.get(call, ""), m.text(), call)
                messages.append({"role": "user", "content": text})
            elif isinstance(m, AssistantMessage) and m.tool_calls:
                messages.append({"role": "assistant", "content": fmt.render_calls(m)})
            else:
                messages.append(_plain(m))
        if show_tools:
            section = fmt.system_text(chat.tools or [])
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + section}
            else:
                messages.insert(0, {"role": "system", "content": section})
        return messages, None

    def tokenize(
        self,
        messages: list[dict[str, Any]],
        tools: TemplateTools | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        try:
            # Any: transformers types it as the union of everything it can return.
            encoded: Any = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as exc:  # noqa: BLE001 - the template's own refusal (raise_exception)
            # A template that refuses these messages (roles out of order, say) is the
            # request's fault: a 400 that says why, not a 500 the client would retry.
            raise errors.InvalidRequest(
                f"the chat template cannot render these messages: {type(exc).__name__}: {exc}"[
                    :1000
                ],
                param="messages",
                code="invalid_messages",
            ) from None
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text's token ids (no chat template)."""
        encoded = self.tokenizer(text, add_special_tokens=add_special_tokens)
        return [int(t) for t in encoded["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        assert isinstance(text, str)  # one sequence in, one text out
        return text

    # -- text completions --------------------------------------------------------------------
    def build_completion(self, req: CompletionRequest) -> list[tuple[list[int], int]]:
        """Each prompt's token ids and effective max_tokens (0: echo only, nothing new)."""
        self.check_model(req.model)
        self._check_max_tokens(req.max_tokens)
        batch = req.prompts()
        out = []
        for i, p in enumerate(batch):
            param = "prompt" if len(batch) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                self.check_chars(len(p), param)
                ids = self.encode(p)
            else:
                bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise errors.InvalidRequest(
                        f"{param}: token id {bad} is not in this "
                        f"model's vocabulary (0..{self.vocab_size - 1})",
                        param=param,
                    )
                ids = list(p)
            if not ids:
                raise errors.InvalidRequest(f"{param}: the prompt has no tokens", param=param)
            asked = req.max_tokens
            default = min(DEFAULT_MAX_TOKENS, self.default_max_tokens)
            max_tokens = self._max_tokens(len(ids), asked or None, param, default)
            out.append((ids, 0 if asked == 0 else max_tokens))
        return out

    # -- limits ----------------------------------------------------------------------------
    def check_chars(self, chars: int, param: str) -> None:
        limit = self.token_limit
        if chars > limit * self.max_token_chars:
            raise errors.InvalidRequest(
                f"{param}: far longer than the {limit}-token limit.",
                param=param,
                code="context_length_exceeded",
            )

    def _max_tokens(self, num_prompt: int, asked: int | None, param: str, default: int) -> int:
        if self.max_prompt_tokens and num_prompt > self.max_prompt_tokens:
            raise errors.InvalidRequest(
                f"{param}: {num_prompt} tokens; this server takes at most "
                f"{self.max_prompt_tokens}.",
                param=param,
                code="context_length_exceeded",
            )
        room = self.max_model_len - num_prompt
        if room < 1:
            raise errors.InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"{param} takes {num_prompt}.",
                param=param,
                code="context_length_exceeded",
            )
        if asked is not None and asked > room:
            raise errors.InvalidRequest(
                f"max_tokens is {asked}, but the prompt leaves room for {room} of this model's "
                f"{self.max_model_len}-token context.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return asked if asked is not None else min(default, room)

    def _check_max_tokens(self, asked: int | None) -> None:
        if asked is not None and self.max_output_tokens and asked > self.max_output_tokens:
            raise errors.InvalidRequest(
                f"max_tokens is {asked}; this server allows at most {self.max_output_tokens}.",
                param="max_tokens",
                code="integer_above_max_value",
            )


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens, text -> id: the added tokens marked special, which
    decoding drops unless told not to."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return {t.content: int(i) for i, t in added.items() if getattr(t, "special", False)}


def _plain(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    return out


def _hf_message(m: ChatMessage) -> dict[str, Any]:
    """transformers' message shape for templates with a tool section."""
    out = _plain(m)
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "id": c.id,
                "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
