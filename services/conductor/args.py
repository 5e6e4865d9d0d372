"""Conductor settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import Field

from shared.settings import BaseSettings, DatabaseSettings, parse_settings


class ConductorSettings(BaseSettings, DatabaseSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")
    policy: Literal["kvcentric", "least_loaded", "largest_prefix", "round_robin", "random"] = Field(
        "kvcentric", description="placement policy")
    ttft_slo_ms: float = Field(30_000.0, gt=0, description="default TTFT SLO (requests may set their own)")
    tbt_slo_ms: float = Field(300.0, gt=0, description="default TBT SLO (requests may set their own)")
    slo_margin: float = Field(0.8, gt=0, le=1, description="admit only requests predicted within "
                              "this share of their SLOs (predictions err)")
    cost_model: str = Field("", description="fitted cost model JSON (empty: HALFMOON_HOME/costmodel.json)")
    balancing_threshold: float = Field(1.5, gt=1, description="kvcentric pulls a prefix when its "
                                       "holder has this many times more blocks")
    pull_prefixes: bool = Field(True, description="pull a longer prefix from another prefill "
                                "instance whatever the policy")
    heartbeat_expiry_s: float = Field(3.0, gt=0, description="an instance silent this long is dead")
    dispatch_timeout_s: float = Field(5.0, gt=0, description="wait for a prefill instance to take a job")
    kv_match_timeout_s: float = Field(0.2, gt=0, description="wait for the KV manager's prefix match")
    min_pull_blocks: int = Field(2, ge=1, description="pull a prefix from another instance when it "
                                 "holds at least this many more blocks")
    instance_record_interval_s: float = Field(5.0, gt=0, description="SQL refresh of instance rows")


def parse_args(argv: Sequence[str] | None = None) -> ConductorSettings:
    return parse_settings(ConductorSettings, argv, "halfmoon serve conductor",
                          "Conductor: instance registry and request placement.")
