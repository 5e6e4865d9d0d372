"""Chat template and tokenization, with the context-length checks that go with them."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from shared import errors
from services.gateway.protocol import ChatCompletionRequest


class PromptBuilder:
    def __init__(self, model_dir: Path, model_name: str, default_max_tokens: int, *,
                 max_messages: int = 0, max_prompt_tokens: int = 0,
                 max_output_tokens: int = 0) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        config = json.loads((model_dir / "config.json").read_text())
        self.max_model_len = int(config.get("max_position_embeddings", 2048))
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

    def build(self, chat: ChatCompletionRequest) -> tuple[list[int], int]:
        """Prompt token ids and the effective max_tokens, or a 4xx error."""
        if chat.model != self.model_name:
            raise errors.ModelNotFound(f"The model '{chat.model}' does not exist; this server "
                                       f"serves '{self.model_name}'", param="model")
        if self.max_messages and len(chat.messages) > self.max_messages:
            raise errors.InvalidRequest(
                f"messages has {len(chat.messages)} entries; this server takes at most "
                f"{self.max_messages}.", param="messages", code="array_above_max_length")
        self._check_max_tokens(chat.requested_max_tokens())
        messages = [{"role": m.role, "content": m.text()} for m in chat.messages]
        if not any(m["content"].strip() for m in messages):
            raise errors.InvalidRequest("messages are all empty", param="messages")
        limit = min(n for n in (self.max_prompt_tokens, self.max_model_len) if n)
        if sum(len(m["content"]) for m in messages) > limit * self.max_token_chars:
            raise errors.InvalidRequest(
                f"The messages are far longer than the {limit}-token limit.", param="messages",
                code="context_length_exceeded")
        ids = self.tokenize(messages)
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            raise errors.InvalidRequest(
                f"The messages have {len(ids)} tokens; this server takes at most "
                f"{self.max_prompt_tokens}.", param="messages", code="context_length_exceeded")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise errors.InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"messages have {len(ids)}.", param="messages", code="context_length_exceeded")
        asked = chat.requested_max_tokens()
        if asked is not None and asked > room:
            raise errors.InvalidRequest(
                f"max_tokens is {asked}, but the prompt leaves room for {room} of this model's "
                f"{self.max_model_len}-token context.", param="max_tokens",
                code="context_length_exceeded")
        return ids, asked if asked is not None else min(self.default_max_tokens, room)

    def _check_max_tokens(self, asked: int | None) -> None:
        if asked is not None and self.max_output_tokens and asked > self.max_output_tokens:
            raise errors.InvalidRequest(
                f"max_tokens is {asked}; this server allows at most {self.max_output_tokens}.",
                param="max_tokens", code="integer_above_max_value")

    def tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]
