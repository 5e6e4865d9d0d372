"""`halfmoon up`'s settings: each field is a flag (and a HALFMOON_* variable), parsed by
shared.settings like every service's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shared.settings import DEFAULT_MODEL_NAME, ContextSettings


class UpSettings(ContextSettings):
    host: str = Field("127.0.0.1", description="address the gateway and console bind")
    port: int = Field(8000, ge=1, le=65535, description="gateway HTTP port")
    console: bool = Field(True, description="start the Streamlit console")
    console_port: int = Field(8501, ge=1, le=65535, description="console HTTP port")
    prefill: int = Field(1, ge=1, description="prefill instances")
    decode: int = Field(1, ge=1, description="decode instances")
    conductors: int = Field(
        1,
        ge=1,
        description="conductors: one leads (places requests), the "
        "others are warm standbys that take over within ~4 s",
    )
    colocated: int = Field(
        0,
        ge=0,
        description="colocated instances that prefill and decode "
        "alike (the usual single-process layout, for comparison); when set, "
        "--prefill/--decode are ignored",
    )
    policy: str = Field("kvcentric", description="the conductor's placement policy")
    planner: Literal["off", "advisory", "active"] = Field(
        "off",
        description="the P/D planner: advisory records the prefill/decode split it would "
        "pick; active switches engine instances between the roles as the load shifts",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from services.conductor.policy import make_policy

        make_policy(v)  # raises ValueError naming the choices
        return v

    model: str = Field(
        DEFAULT_MODEL_NAME, description="model folder or name in HALFMOON_HOME/models"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="auto | float32 | bfloat16 (auto: bfloat16 where the CPU computes it natively)",
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="engine weights: none, or int8 (weight-only, per output channel)",
    )
    lean_weights: bool = Field(
        False,
        description="engines keep each weight once and release transformers' copies "
        "(a third of the memory; some prefill speed on CPUs with AMX)",
    )
    threads: int = Field(
        0, ge=0, description="torch threads per engine instance (0: cores / instances)"
    )
    pin_engines: bool = Field(
        False,
        description="pin each engine instance to its own cores (`threads` each, in start "
        "order, round-robin over the cores this process may use): prefill stages that "
        "must not share a core, and benchmarks that say what ran where",
    )
    engine_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="niceness of engine processes, so the "
        "control plane stays responsive when the cores are busy",
    )
    # None: each engine's own default (1 GiB, or its HALFMOON_KV_CACHE_GB), so the tools
    # that build these settings in code do not override an operator's variable.
    kv_cache_gb: float | None = Field(
        None, gt=0, description="KV pool (DRAM tier) of each engine instance, in GiB (default 1)"
    )
    # None: each decode engine's own default (0, or its HALFMOON_NUM_SPECULATIVE_TOKENS).
    num_speculative_tokens: int | None = Field(
        None,
        ge=0,
        le=16,
        description="prompt-lookup speculative decoding on decode (and colocated) "
        "instances: drafts per step at most (0: off; a request's num_speculative_tokens "
        "overrides it)",
    )
    tool_format: str = Field(
        "", description="the gateway's tool-call format (empty: the one for the model's family)"
    )
    nats_url: str = Field("", description="external NATS (empty: embedded nats-server)")
    database_url: str = Field("", description="SQLAlchemy URL (empty: SQLite in HALFMOON_HOME)")
    ready_timeout_s: float = Field(300.0, gt=0, description="give up if not ready by then")
    log_level: str = Field("INFO", description="logging level for every service")
    restart: bool = Field(
        True, description="start a service that dies again (off: stop the cluster when one dies)"
    )
    restart_backoff_s: float = Field(
        1.0,
        gt=0,
        description="first restart delay; it doubles "
        "each time the same service dies young, up to the max",
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, description="longest restart delay")
    metrics_base_port: int = Field(
        9100,
        ge=0,
        le=65535,
        description="Prometheus /metrics: "
        "conductor, kvmanager and each engine get one port each from "
        "here up, in start order (listed in the banner); 0: off. "
        "The gateway serves /metrics on its API port",
    )
