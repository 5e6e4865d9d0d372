"""Simulated outcomes in a live run's terms: each outcome as the replay records a live request,
and the run's summary over them (shared.run_summary), so the simulator and `bench replay`
define goodput, effective capacity and every latency figure once."""

from __future__ import annotations

import math
from typing import Any, Sequence

from services.tools.sim.model import Outcome
from shared.run_summary import ReplayedRequest, Slos, summarize


def as_record(o: Outcome, block_tokens: int) -> ReplayedRequest:
    """A simulated outcome as the replay records a live one (prompt lengths with the
    template's header: the live summary's hit ratio divides by those too)."""
    req = o.request
    rec = ReplayedRequest(
        req.index,
        req.arrival_s,
        0.0,
        req.input_length,
        req.output_length,
        "rejected" if o.rejected else "completed",
    )
    if not o.rejected:
        rec.prompt_tokens, rec.completion_tokens = req.input_length, req.output_length
        rec.cached_tokens = o.hit_tokens(block_tokens)
        rec.ttft_s, rec.e2e_s = o.ttft_s, o.finish_s - req.arrival_s
        rec.tbt_s = None if math.isnan(o.tbt_s) else o.tbt_s
    return rec


def summarize_outcomes(
    outcomes: Sequence[Outcome], block_tokens: int, slos: Slos, ideal_hit_ratio: float
) -> dict[str, Any]:
    """Simulated outcomes in the replay's summary, over the simulated span (first arrival
    to last token)."""
    records = [as_record(o, block_tokens) for o in outcomes]
    start = min((o.request.arrival_s for o in outcomes), default=0.0)
    end = max((o.finish_s for o in outcomes if not o.rejected), default=start)
    return summarize(records, end - start, slos, ideal_hit_ratio)
