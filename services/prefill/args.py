"""Prefill settings (flags and HALFMOON_ env vars)."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field

from services.worker.settings import WorkerSettings
from shared.settings import parse_settings


class PrefillSettings(WorkerSettings):
    max_queue: int = Field(256, gt=0, description="jobs queued before new ones are refused")
    stream_handoff: bool = Field(
        True,
        description="send a prompt of more than one chunk to decode chunk by chunk while "
        "it is computed (off: all its KV after the first token)",
    )
    decode_reuse: bool = Field(
        True,
        description="before a handoff, ask the decode instance which leading blocks of the "
        "prompt it caches already (an earlier turn's) and send only the rest (off: the "
        "whole prompt's KV moves)",
    )
    hold_timeout_s: float = Field(
        2.0,
        gt=0,
        description="how long a handoff waits for decode to say which blocks it holds "
        "(decode-side reuse) before it sends them all",
    )
    stage_kv_gb: float = Field(
        0.25,
        ge=0,
        description="KV pool for the pipelined-prefill stages this instance runs (its own: "
        "a stage's blocks hold some of the layers); 0: it runs none",
    )


def parse_args(argv: Sequence[str] | None = None) -> PrefillSettings:
    return parse_settings(
        PrefillSettings,
        argv,
        "halfmoon serve prefill",
        "Prefill instance: prompt → first token + KV handoff to decode.",
    )
