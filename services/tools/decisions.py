"""Reading the conductor's decision records (the `decisions` table), for the tools that
must show where a request ran: bench cpp checks each prompt's layout, chaos counts the
requests it put on pipelined groups."""

from __future__ import annotations

import json
from typing import Any


def stages_of(predicted_ttft_ms: float | None, candidates: str | list[Any] | None) -> int:
    """How many prefill instances a decision put its request on (1: a single instance, 0:
    no placement: refused, or not written yet). The chosen candidate is the one whose
    predicted TTFT is the one the decision records; `candidates` is the column's JSON, as
    text (sqlite3) or parsed (SQLAlchemy)."""
    if predicted_ttft_ms is None:
        return 0
    rows = json.loads(candidates) if isinstance(candidates, str) else (candidates or [])
    for c in rows:
        if abs(float(c.get("ttft_ms", -1.0)) - predicted_ttft_ms) < 1e-6:
            return len(c.get("stages") or []) or 1
    return 0
