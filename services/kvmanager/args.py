"""KV manager settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field

from shared.settings import BaseSettings, DatabaseSettings, parse_settings


class KVManagerSettings(BaseSettings, DatabaseSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")
    stream_max_age_s: float = Field(24 * 3600.0, gt=0, description="KV event stream retention")
    stream_max_bytes: int = Field(1 << 30, gt=0, description="KV event stream size limit")
    stream_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="JetStream replicas of the KV event stream "
        "(3 on a NATS cluster, so losing one server loses no event)",
    )
    metadata_flush_s: float = Field(1.0, gt=0, description="seconds between kv_blocks SQL flushes")
    hot_rps: float = Field(
        0.5, gt=0, description="a cached prefix hit this often a second is hot (replicated)"
    )
    heat_half_life_s: float = Field(
        5.0, gt=0, description="half-life of a prefix's hit count, seconds (heat.py)"
    )


def parse_args(argv: Sequence[str] | None = None) -> KVManagerSettings:
    return parse_settings(
        KVManagerSettings,
        argv,
        "halfmoon serve kvmanager",
        "KV manager: the cluster-wide index of cached KV blocks.",
    )
