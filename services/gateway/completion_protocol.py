"""The legacy text completions request (POST /v1/completions), as OpenAI and vLLM take it:
what benchmark clients (vllm bench serve, guidellm, aiperf) and evaluation harnesses
(lm-eval's local-completions) send."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from services.gateway.protocol import SamplingFields, parse_body
from services.gateway.validation import Integral
from shared import errors

# OpenAI's default for /v1/completions (chat's is what the context leaves).
DEFAULT_MAX_TOKENS = 16


def _prompt_schema(schema: dict[str, Any]) -> None:
    """No empty prompt, no empty list of prompts (the validator refuses both)."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1
            items = branch.get("items", {})
            if items.get("type") == "string":
                items["minLength"] = 1
            elif items.get("type") == "array":
                items["minItems"] = 1


class CompletionRequest(SamplingFields):
    # A string, a batch of strings, token ids, or a batch of token id lists.
    prompt: str | list[str] | list[Integral] | list[list[Integral]] = Field(
        json_schema_extra=_prompt_schema
    )
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(
        None, ge=1, le=128, description="Must equal n: samples are not ranked (as in vLLM V1)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise errors.InvalidRequest(
                "best_of other than n is not supported (no ranking of samples)",
                param="best_of",
                code="unsupported_parameter",
            )
        if self.max_tokens == 0 and not self.echo:
            raise errors.InvalidRequest(
                "max_tokens: 0 needs echo: true (it only scores the prompt)", param="max_tokens"
            )
        prompts = self.prompts()
        if not prompts or any(not p for p in prompts):
            raise errors.InvalidRequest("prompt: no prompt may be empty", param="prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch, each prompt a string or a token id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        return self.logprobs


def parse_completion(body: Any) -> CompletionRequest:
    return parse_body(CompletionRequest, body)
