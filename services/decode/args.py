"""Decode settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from shared.engine.instance import WorkerSettings
from shared.settings import parse_settings


class DecodeSettings(WorkerSettings):
    """Decode uses the shared worker settings (pool size, batch size) as they are."""


def parse_args(argv: Sequence[str] | None = None) -> DecodeSettings:
    return parse_settings(DecodeSettings, argv, "halfmoon serve decode",
                          "Decode instance: KV from prefill → remaining tokens, streamed.")
