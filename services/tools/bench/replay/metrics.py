"""A live request's measurements from the streaming client's result (the summary itself is
shared.run_summary's, which the simulator uses too)."""

from __future__ import annotations

from services.tools.bench.client import Result
from shared.run_summary import ReplayedRequest

REJECTED_STATUSES = (429, 503)


def record_from(
    index: int,
    arrival_s: float,
    send_lag_s: float,
    input_tokens: int,
    output_tokens: int,
    res: Result,
) -> ReplayedRequest:
    if res.ok:
        status = "completed"
    elif res.status in REJECTED_STATUSES:
        status = "rejected"
    else:
        status = "failed"
    rec = ReplayedRequest(
        index,
        arrival_s,
        send_lag_s,
        input_tokens,
        output_tokens,
        status,
        res.status,
        res.prompt_tokens,
        res.cached_tokens,
        res.completion_tokens,
        error=res.error[:300],
        text=res.text,
    )
    if res.ok:
        gaps = res.gaps_s
        rec.ttft_s, rec.e2e_s, rec.tbt_s, rec.itl_s = res.ttft_s, res.end_s, res.tbt_s, gaps
        rec.tpot_s = sum(gaps) / len(gaps) if gaps else None
    return rec
