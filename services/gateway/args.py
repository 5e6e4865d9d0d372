"""Gateway settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field

from shared.settings import DEFAULT_MODEL_NAME, BaseSettings, DatabaseSettings, parse_settings


class GatewaySettings(BaseSettings, DatabaseSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    model: str = Field(DEFAULT_MODEL_NAME, description="model folder (tokenizer, chat template, config)")
    served_model_name: str = Field("", description="model name clients use (empty: folder name)")
    block_size: int = Field(16, gt=0, description="KV block size in tokens for prefix hashes")
    default_max_tokens: int = Field(512, gt=0, description="max_tokens when a request gives none")
    max_body_bytes: int = Field(4 << 20, gt=0, description="largest request body accepted")
    schedule_timeout_s: float = Field(10.0, gt=0, description="wait for the conductor's placement")
    first_token_timeout_s: float = Field(300.0, gt=0, description="wait for the first token")
    token_timeout_s: float = Field(60.0, gt=0, description="wait between two tokens")


def parse_args(argv: Sequence[str] | None = None) -> GatewaySettings:
    return parse_settings(GatewaySettings, argv, "halfmoon serve gateway",
                          "Gateway: OpenAI-compatible chat completions over HTTP/SSE.")
