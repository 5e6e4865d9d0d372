"""`halfmoon chaos` settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, Field, field_validator

from shared.settings import DEFAULT_MODEL_NAME, parse_settings

TARGETS = ("prefill", "decode", "conductor", "kvmanager", "nats")
# Not in the default round: a role switch begun under load, then a kill while it drains
# (of the switching instance, or of the conductor). chaos/switches.py.
SWITCH_TARGETS = ("switching", "switch-conductor")


class ChaosSettings(BaseModel):
    duration_s: float = Field(60.0, gt=0, description="how long load and faults run")
    rate: float = Field(2.0, gt=0, description="requests per second (Poisson arrivals)")
    kill_every_s: float = Field(
        12.0,
        gt=0,
        description="one SIGKILL this often (±20%%), the targets in turn, in a seeded order",
    )
    seed: int = Field(0, description="seeds prompts, arrivals and the kill order")
    targets: str = Field(
        ",".join(TARGETS),
        description="what to kill, comma separated: " + ", ".join((*TARGETS, *SWITCH_TARGETS)),
    )
    max_tokens: int = Field(
        24,
        gt=0,
        description="tokens each request streams (end of "
        "sequence ignored, so a completed request has exactly this many)",
    )
    long_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of requests with a long prompt (long_words words): more than "
        "one prefill chunk, so their KV streams to decode and kills land mid-stream",
    )
    long_words: int = Field(600, gt=0, description="words in a long prompt")
    chunk_tokens: int = Field(
        0, ge=0, description="a started cluster's prefill chunk in tokens (0: the default)"
    )
    request_deadline_s: float = Field(
        150.0,
        gt=0,
        description="a request with no terminal event (finish or error) by then is hung",
    )
    recovery_s: float = Field(
        120.0,
        gt=0,
        description="after the faults, the cluster must serve a request again within this",
    )
    # The cluster: started here unless --url names one to attach to.
    url: str = Field(
        "",
        description="attach to the cluster behind this gateway URL (empty: "
        "start a local one); its `halfmoon up` restarts what is killed",
    )
    nats_url: str = Field("", description="attached cluster's NATS (finds pids by heartbeat)")
    database_url: str = Field(
        "",
        description="attached cluster's SQL (empty: SQLite in "
        "HALFMOON_HOME); a started cluster gets a fresh one",
    )
    prefill: int = Field(2, ge=1, description="prefill instances of a started cluster")
    decode: int = Field(2, ge=1, description="decode instances of a started cluster")
    model: str = Field(DEFAULT_MODEL_NAME, description="model folder or name")
    dtype: str = Field(
        "auto",
        description="auto | float32 | bfloat16 (auto: bfloat16 where the CPU computes it natively)",
    )
    token_timeout_s: float = Field(
        20.0,
        gt=0,
        description="a started cluster's gateway: "
        "silence between tokens before a request is placed again",
    )
    log_level: str = Field("WARNING", description="a started cluster's services' log level")
    report: str = Field("", description="also write the report here as JSON")

    @field_validator("targets")
    @classmethod
    def _known(cls, v: str) -> str:
        known = (*TARGETS, *SWITCH_TARGETS)
        bad = [t for t in v.split(",") if t.strip() not in known]
        if bad or not v.strip():
            raise ValueError(f"unknown targets {bad}; choose from {', '.join(known)}")
        return v

    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",")]


def parse_args(argv: Sequence[str] | None = None) -> ChaosSettings:
    return parse_settings(
        ChaosSettings,
        argv,
        "halfmoon chaos",
        "Kill cluster parts under load; report hung requests and lost records (exit 1 if any).",
    )
