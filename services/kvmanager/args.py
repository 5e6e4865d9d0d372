"""KV manager settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field

from shared.settings import BaseSettings, parse_settings


class KVManagerSettings(BaseSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")


def parse_args(argv: Sequence[str] | None = None) -> KVManagerSettings:
    return parse_settings(KVManagerSettings, argv, "halfmoon serve kvmanager",
                          "KV manager: the cluster-wide index of cached KV blocks.")
