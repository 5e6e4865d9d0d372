"""Conductor settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import Field, model_validator

from services.conductor.planner import PlannerSettings
from services.conductor.replication import ReplicationSettings
from shared.settings import BaseSettings, DatabaseSettings, parse_settings


class ConductorSettings(BaseSettings, DatabaseSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")
    policy: Literal["kvcentric", "least_loaded", "largest_prefix", "round_robin", "random"] = Field(
        "kvcentric", description="placement policy"
    )
    ttft_slo_ms: float = Field(
        30_000.0, gt=0, description="default TTFT SLO (requests may set their own)"
    )
    tbt_slo_ms: float = Field(
        300.0, gt=0, description="default TBT SLO (requests may set their own)"
    )
    slo_margin: float = Field(
        0.8,
        gt=0,
        le=1,
        description="admit only requests predicted within "
        "this share of their SLOs (predictions err)",
    )
    cost_model: str = Field(
        "", description="fitted cost model JSON (empty: HALFMOON_HOME/costmodel.json)"
    )
    balancing_threshold: float = Field(
        1.5,
        gt=1,
        description="kvcentric pulls a prefix when its "
        "holder has this many times more blocks (inf: never; "
        "the other policies never pull)",
    )
    layout: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="colocated: the (prefill) instance chosen for a request "
        "decodes it too, and there are no decode instances",
    )
    max_stages: int = Field(
        1,
        ge=1,
        le=16,
        description="pipelined prefill: kvcentric weighs groups of up to this many idle "
        "prefill instances, each running a range of the layers (1: off)",
    )
    pipeline_min_tokens: int = Field(
        0,
        ge=0,
        description="prompts of at least this many tokens are weighed for a group "
        "(0: only those no single instance prefills within the TTFT SLO)",
    )
    planner: Literal["off", "advisory", "active"] = Field(
        "off",
        description="the P/D planner: off; advisory (decides and records, switches "
        "nothing); active (switches engine instances between prefill and decode)",
    )
    planner_interval_s: float = Field(5.0, gt=0, description="how often the planner decides")
    planner_window_s: float = Field(
        30.0, gt=0, description="the arrivals and finished requests the planner looks at"
    )
    planner_min_gain: float = Field(
        0.10, ge=0, description="relative goodput gain a switch must bring"
    )
    planner_cooldown_s: float = Field(
        15.0, ge=0, description="after a switch the planner decides, before the next may be"
    )
    planner_horizon_s: float = Field(
        60.0, gt=0, description="how long a switch's gain is weighed against its drain"
    )
    replicate: bool = Field(
        True, description="copy hot prefixes to more prefill instances ahead of demand"
    )
    replicate_max_busy: float = Field(
        0.5,
        gt=0,
        le=1,
        description="a hot prefix gets another holder once its load would keep its "
        "holders busier than this share of their time",
    )
    replicate_blocks_per_s: float = Field(
        2048.0, gt=0, description="replication budget: KV blocks copied per second"
    )
    replicate_mib_per_s: float = Field(
        512.0, gt=0, description="replication budget: MiB of KV copied per second"
    )
    switch_drain_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a role switch gives up (the instance stays in its role) if what it "
        "holds has not finished in this long",
    )
    heartbeat_expiry_s: float = Field(3.0, gt=0, description="an instance silent this long is dead")
    dispatch_timeout_s: float = Field(
        5.0, gt=0, description="wait for a prefill instance to take a job"
    )
    stage_open_timeout_s: float = Field(
        5.0,
        gt=0,
        description="wait for a pipelined-prefill stage to open a prompt (a stage answers "
        "before it builds a layer range's pool; the gateway waits 10 s for the placement)",
    )
    kv_match_timeout_s: float = Field(
        0.2, gt=0, description="wait for the KV manager's prefix match"
    )
    instance_record_interval_s: float = Field(
        5.0,
        gt=0,
        description="SQL refresh of instance rows "
        "and of load samples (one per instance per interval)",
    )
    load_retention_s: float = Field(
        24 * 3600.0, gt=0, description="load samples older than this are deleted"
    )
    request_retention_s: float = Field(
        7 * 24 * 3600.0,
        ge=0,
        description="finished request records, decisions and dead instances' rows older "
        "than this are deleted (0: kept for ever)",
    )
    election: bool = Field(
        True,
        description="run active/standby: only the holder of a NATS KV "
        "lease places requests (off: every conductor places, as a queue group)",
    )
    lease_ttl_s: float = Field(
        3.0,
        gt=0,
        description="leader lease TTL: a dead leader is replaced "
        "within about this plus half the renewal interval",
    )
    lease_renew_s: float = Field(
        1.0, gt=0, description="leader lease renewal interval (at most half the TTL)"
    )
    lease_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="JetStream replicas of the lease bucket "
        "(3 on a NATS cluster, so losing one server keeps the election)",
    )

    @model_validator(mode="after")
    def _renew_within_ttl(self) -> ConductorSettings:
        if 2 * self.lease_renew_s > self.lease_ttl_s:
            raise ValueError("lease_renew_s must be at most half of lease_ttl_s")
        return self


def parse_args(argv: Sequence[str] | None = None) -> ConductorSettings:
    return parse_settings(
        ConductorSettings,
        argv,
        "halfmoon serve conductor",
        "Conductor: instance registry and request placement.",
    )


def replication_settings(s: ConductorSettings) -> ReplicationSettings:
    return ReplicationSettings(
        enabled=s.replicate,
        max_busy=s.replicate_max_busy,
        blocks_per_s=s.replicate_blocks_per_s,
        bytes_per_s=s.replicate_mib_per_s * 2**20,
    )


def planner_settings(s: ConductorSettings) -> PlannerSettings:
    return PlannerSettings(
        mode=s.planner,
        interval_s=s.planner_interval_s,
        window_s=s.planner_window_s,
        min_gain=s.planner_min_gain,
        cooldown_s=s.planner_cooldown_s,
        horizon_s=s.planner_horizon_s,
    )
