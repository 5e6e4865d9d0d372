"""Gateway settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import ConfigDict, Field, field_validator, model_validator

from services.gateway.keys import parse_key_specs, parse_rate_limit, read_key_file
from services.gateway.tools import FORMATS
from shared.settings import (
    DEFAULT_MODEL_NAME,
    BaseSettings,
    ContextSettings,
    DatabaseSettings,
    parse_settings,
)


class GatewaySettings(BaseSettings, DatabaseSettings, ContextSettings):
    # A bad value must not echo into logs or a terminal: it may hold API keys.
    model_config = ConfigDict(hide_input_in_errors=True)

    instance_id: str = Field("", description="instance id (empty: generated)")
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    model: str = Field(
        DEFAULT_MODEL_NAME, description="model folder (tokenizer, chat template, config)"
    )
    served_model_name: str = Field("", description="model name clients use (empty: folder name)")
    block_size: int = Field(16, gt=0, description="KV block size in tokens for prefix hashes")
    default_max_tokens: int = Field(512, gt=0, description="max_tokens when a request gives none")
    max_body_bytes: int = Field(4 << 20, gt=0, description="largest request body accepted")
    schedule_timeout_s: float = Field(10.0, gt=0, description="wait for the conductor's placement")
    schedule_retry_s: float = Field(
        8.0,
        ge=0,
        description="while no conductor answers (a "
        "standby takes over within ~4 s), keep asking this long",
    )
    first_token_timeout_s: float = Field(300.0, gt=0, description="wait for the first token")
    token_timeout_s: float = Field(60.0, gt=0, description="wait between two tokens")
    # Faults: a request whose instance dies, or whose token events are lost (a NATS
    # restart), is placed again: before its first token through the conductor, after it on
    # a live decode instance that recomputes prompt + tokens so far. Past the limit: an error.
    instance_expiry_s: float = Field(
        3.0,
        gt=0,
        description="an instance whose heartbeats stop "
        "this long (while others' arrive) has lost its requests",
    )
    gap_timeout_s: float = Field(
        2.0,
        gt=0,
        description="a missing token event with later ones already here is lost after this long",
    )
    max_replacements: int = Field(
        2,
        ge=0,
        description="times a request is placed again after "
        "an instance failure or lost events (0: fail at once)",
    )
    replace_wait_s: float = Field(
        30.0, ge=0, description="wait this long for a live decode instance to continue a request on"
    )
    # Input limits: past any of them a request gets a 400 before it is tokenized or placed.
    max_messages: int = Field(256, gt=0, description="most messages in one request")
    max_prompt_tokens: int = Field(
        0, ge=0, description="most prompt tokens (0: the model's context length)"
    )
    max_output_tokens: int = Field(
        0, ge=0, description="largest max_tokens a request may ask for (0: what the context leaves)"
    )
    max_choices: int = Field(
        16, gt=0, le=128, description="largest n (completions made from one prompt)"
    )
    max_prompts: int = Field(32, gt=0, description="most prompts in one text completions batch")
    tool_format: str = Field(
        "",
        description="tool-call format of the model "
        f"(empty: the one for its family; known: {', '.join(FORMATS)})",
    )
    # API keys: off unless asked for, so `halfmoon up` works as it is.
    require_api_key: bool = Field(
        False,
        description="check API keys on /v1/* and /admin/* "
        "(keys from `halfmoon keys create`); implied by --api-keys "
        "and --admin-key",
    )
    api_keys: str = Field(
        "",
        description="keys given here rather than in SQL: "
        "TENANT:KEY[:RATE],... (prefer the env var: flags show in ps)",
    )
    admin_key: str = Field("", description="the key for /admin/* (prefer the env var)")
    admin_key_file: str = Field(
        "",
        description="read the key for /admin/* from this file "
        "(`halfmoon keys init-admin` writes one; compose does so on "
        "first start)",
    )
    default_rate_limit: str = Field(
        "",
        description="per-key request rate for keys without "
        "their own, e.g. 60/minute or 5/second;1000/day (empty: none)",
    )
    key_cache_s: float = Field(
        5.0,
        ge=0,
        description="how long a key looked up in SQL is "
        "trusted (a revoked key stops working within this)",
    )

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, v: str) -> str:
        parse_key_specs(v)
        return v

    @field_validator("admin_key_file")
    @classmethod
    def _admin_key_file(cls, v: str) -> str:
        if v:
            read_key_file(v)  # missing, unreadable or empty: say so at start
        return v

    @field_validator("tool_format")
    @classmethod
    def _tool_format(cls, v: str) -> str:
        if v and v not in FORMATS:
            raise ValueError(f"unknown tool format {v!r}; known: {', '.join(FORMATS)}")
        return v

    @field_validator("default_rate_limit")
    @classmethod
    def _rate(cls, v: str) -> str:
        parse_rate_limit(v)
        return v

    @model_validator(mode="after")
    def _limits(self) -> GatewaySettings:
        if self.max_output_tokens and self.default_max_tokens > self.max_output_tokens:
            raise ValueError("default_max_tokens is above max_output_tokens")
        return self

    def keys_enabled(self) -> bool:
        return (
            self.require_api_key
            or bool(self.api_keys.strip())
            or bool(self.admin_key)
            or bool(self.admin_key_file)
        )

    def admin_secret(self) -> str:
        """The admin key from the setting or, failing that, from its file ("" if neither)."""
        if self.admin_key:
            return self.admin_key
        return read_key_file(self.admin_key_file) if self.admin_key_file else ""


def parse_args(argv: Sequence[str] | None = None) -> GatewaySettings:
    return parse_settings(
        GatewaySettings,
        argv,
        "halfmoon serve gateway",
        "Gateway: OpenAI-compatible chat completions over HTTP/SSE.",
    )
