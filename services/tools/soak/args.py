"""`halfmoon soak` settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, Field, field_validator

from services.tools.chaos.args import TARGETS
from shared.settings import DEFAULT_MODEL_NAME, parse_settings


class SoakSettings(BaseModel):
    minutes: float = Field(60.0, gt=0, description="how long traffic runs")
    rate: float = Field(1.0, gt=0, description="requests per second (Poisson arrivals)")
    max_tokens: int = Field(16, gt=0, description="tokens each request may generate")
    leave_share: float = Field(
        0.1, ge=0, le=1, description="share of clients that leave mid-request"
    )
    kill_every_s: float = Field(
        600.0, ge=0, description="one SIGKILL this often, the targets in turn (0: no faults)"
    )
    targets: str = Field(
        "prefill,decode,conductor,kvmanager",
        description="what to kill, comma separated: " + ", ".join(TARGETS),
    )
    sample_s: float = Field(10.0, gt=0, description="how often everything is sampled")
    warmup_s: float = Field(
        120.0, ge=0, description="a process is sampled from this long after it is first seen"
    )
    retention_s: float = Field(
        0.0,
        ge=0,
        description="the cluster's SQL and JetStream retention (0: a quarter of the run, so "
        "the second half shows whether they hold their bound)",
    )
    request_deadline_s: float = Field(
        120.0, gt=0, description="a request with no answer by then is hung"
    )
    seed: int = Field(0, description="seeds requests, arrivals and the kill order")
    prefill: int = Field(1, ge=1, description="prefill instances")
    decode: int = Field(1, ge=1, description="decode instances")
    model: str = Field(DEFAULT_MODEL_NAME, description="model folder or name")
    dtype: str = Field("auto", description="auto | float32 | bfloat16")
    log_level: str = Field("WARNING", description="the services' log level")
    report: str = Field("", description="also write the report here as JSON")
    judge: str = Field(
        "",
        description="no run: judge the samples of a saved --report again with this "
        "version's rules, and print its summary (with --report, write it there)",
    )

    @field_validator("targets")
    @classmethod
    def _known(cls, v: str) -> str:
        bad = [t for t in v.split(",") if t.strip() not in TARGETS]
        if bad:
            raise ValueError(f"unknown targets {bad}; choose from {', '.join(TARGETS)}")
        return v

    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def retention(self) -> float:
        return self.retention_s or max(60.0, self.duration_s / 4)


def parse_args(argv: Sequence[str] | None = None) -> SoakSettings:
    return parse_settings(
        SoakSettings,
        argv,
        "halfmoon soak",
        "Mixed traffic, cancels and faults for --minutes; fail on unbounded growth of memory, "
        "descriptors, threads, SQL or JetStream, or on any hung or lost request.",
    )
