"""The P/D planner's record: its decisions (plan_decisions) and the role switches it or an
admin asked for (role_switches). SQL reads, then plain-data series and table rows.

Like console.history, the reads take an open connection (console.queries owns engines,
timeouts and error messages) and the rest is pure Python over dicts, tested without
Streamlit. The planner may decide every few seconds, so the chart reads only the split
columns of the window and keeps the points where a split changed; the full rows (with
their forecast and estimates) are read only for the decisions the table shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.db.schema import PlanDecisionRecord, RoleSwitchRecord

MAX_DECISIONS = 50_000  # newest first: a decision every 5 s is 17,280 a day
TABLE_ROWS = 200  # newest decisions that switched, or would have; newest role switches
SPLIT_COLUMNS = (
    "created",
    "mode",
    "current_prefill",
    "current_decode",
    "best_prefill",
    "best_decode",
    "switch_instance",
    "switch_from",
    "switch_to",
    "acted",
)
NO_DECISIONS = "No planner decisions yet (the planner is off: start with --planner advisory)."


@dataclass
class PlannerData:
    """What one refresh reads for the Planner page."""

    now: float
    splits: list[dict[str, Any]] = field(default_factory=list)  # SPLIT_COLUMNS, oldest first
    notable: list[dict[str, Any]] = field(default_factory=list)  # full rows, newest first
    latest: dict[str, Any] | None = None  # the newest decision, full row, any age
    switches: list[dict[str, Any]] = field(default_factory=list)  # newest first


# -- SQL ------------------------------------------------------------------------------
async def read_planner(conn: AsyncConnection, since: float | None, now: float) -> PlannerData:
    d = PlanDecisionRecord.__table__
    window = [] if since is None else [d.c.created >= since]
    split_rows = await conn.execute(
        select(*(d.c[c] for c in SPLIT_COLUMNS))
        .where(*window)
        .order_by(d.c.created.desc(), d.c.id.desc())
        .limit(MAX_DECISIONS)
    )
    changed = or_(
        d.c.switch_instance.is_not(None),
        d.c.current_prefill != d.c.best_prefill,
        d.c.current_decode != d.c.best_decode,
    )
    notable = await conn.execute(
        select(d)
        .where(changed, *window)
        .order_by(d.c.created.desc(), d.c.id.desc())
        .limit(TABLE_ROWS)
    )
    latest = (
        await conn.execute(select(d).order_by(d.c.created.desc(), d.c.id.desc()).limit(1))
    ).first()
    s = RoleSwitchRecord.__table__
    switches = await conn.execute(
        select(s)
        .where(*([] if since is None else [s.c.requested_at >= since]))
        .order_by(s.c.requested_at.desc())
        .limit(TABLE_ROWS)
    )
    return PlannerData(
        now=now,
        splits=[dict(r._mapping) for r in reversed(split_rows.all())],
        notable=[dict(r._mapping) for r in notable],
        latest=None if latest is None else dict(latest._mapping),
        switches=[dict(r._mapping) for r in switches],
    )


# -- series ---------------------------------------------------------------------------
def split_steps(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The split (and the best split) over time as step points: the first decision, each
    one whose split differs from the previous, and the last (so the line reaches now)."""
    keys = ("current_prefill", "current_decode", "best_prefill", "best_decode")
    kept = [
        r
        for i, r in enumerate(rows)
        if i in (0, len(rows) - 1) or any(r[k] != rows[i - 1][k] for k in keys)
    ]
    return {"t": [r["created"] for r in kept], **{k: [r[k] for r in kept] for k in keys}}


def switch_marks(data: PlannerData) -> list[dict[str, Any]]:
    """Where switches happened (role_switches, any status) and where the planner would have
    switched but did not act (advisory decisions), oldest first."""
    marks = [
        {
            "t": s["requested_at"],
            "kind": s["status"],
            "text": f"{s['instance_id']}: {s['from_role'] or '?'} → {s['to_role']} "
            f"({s['source']}, {s['status']})",
        }
        for s in data.switches
    ]
    marks += [
        {
            "t": r["created"],
            "kind": "advised",
            "text": f"would switch {r['switch_instance']}: {r['switch_from']} → {r['switch_to']}",
        }
        for r in data.splits
        if r["switch_instance"] and not r["acted"]
    ]
    return sorted(marks, key=lambda m: m["t"])


def roles_from_samples(samples: list[dict[str, Any]], bucket_s: float) -> dict[str, list[Any]]:
    """Without planner decisions: instances per role in each bucket, as the conductor's load
    samples saw them (an instance counts in every role it reported within the bucket)."""
    seen: dict[float, set[tuple[str, str]]] = {}
    for s in samples:
        start = math.floor(s["t"] / bucket_s) * bucket_s
        seen.setdefault(start, set()).add((s["instance_id"], s["role"]))
    buckets = sorted(seen)
    return {
        "t": buckets,
        "prefill": [sum(1 for _, role in seen[b] if role == "prefill") for b in buckets],
        "decode": [sum(1 for _, role in seen[b] if role == "decode") for b in buckets],
    }


# -- tables ---------------------------------------------------------------------------
def goodput(decision: dict[str, Any], prefill: int, decode: int) -> float | None:
    """The predicted goodput (requests/s) the decision weighed for one split."""
    for e in decision.get("estimates") or []:
        if isinstance(e, dict) and (e.get("prefill"), e.get("decode")) == (prefill, decode):
            value = e.get("goodput_rps")
            return float(value) if isinstance(value, (int, float)) else None
    return None


def switch_text(decision: dict[str, Any]) -> str:
    if not decision.get("switch_instance"):
        return ""
    return (
        f"{decision['switch_instance']}: {decision.get('switch_from')} → "
        f"{decision.get('switch_to')}"
    )


def decision_rows(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per decision: split and best split, the switch, predicted goodput."""
    rows = []
    for d in decisions:
        now, best = (
            (d["current_prefill"], d["current_decode"]),
            (d["best_prefill"], d["best_decode"]),
        )
        rows.append(
            {
                "created": d["created"],
                "mode": d["mode"],
                "split": f"{now[0]}P:{now[1]}D",
                "best": f"{best[0]}P:{best[1]}D",
                "switch": switch_text(d),
                "acted": bool(d["acted"]),
                "goodput_now_rps": goodput(d, *now),
                "goodput_best_rps": goodput(d, *best),
                "drain_s": d.get("drain_s"),
                "attainment": d.get("attainment"),
                "reason": d.get("reason") or "",
            }
        )
    return rows


def switch_rows(switches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "requested_at": s["requested_at"],
            "instance": s["instance_id"],
            "switch": f"{s['from_role'] or '?'} → {s['to_role']}",  # refused: maybe unknown
            "source": s["source"],
            "status": s["status"],
            "drain_s": s.get("drain_s"),
            "finished_at": s.get("finished_at"),
            "detail": s.get("detail") or "",
        }
        for s in switches
    ]
