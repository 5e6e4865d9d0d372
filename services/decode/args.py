"""Decode settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field

from services.worker.settings import WorkerSettings
from shared.settings import parse_settings


class DecodeSettings(WorkerSettings):
    """The shared worker settings (pool size, batch size), and the handoff queue's bound."""

    max_queued_handoffs: int = Field(
        256,
        gt=0,
        description="handoffs waiting for KV pool room (not fetched yet) at most; "
        "further ones are refused, so the conductor places them elsewhere",
    )


def parse_args(argv: Sequence[str] | None = None) -> DecodeSettings:
    return parse_settings(
        DecodeSettings,
        argv,
        "halfmoon serve decode",
        "Decode instance: KV from prefill → remaining tokens, streamed.",
    )
