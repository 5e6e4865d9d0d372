"""Load history, KV cache contents and placement reasons: SQL reads and plain-data series.

The reads take an open connection (console.queries owns engines, timeouts and error
messages); everything else is pure Python over dicts so it is tested without Streamlit.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.db.load_samples import ACTIVITY
from shared.db.schema import DecisionRecord, KVBlockRecord, LoadSample
from shared.hashing import from_signed

MAX_SAMPLES = 50_000  # newest first: 24 h of 5 s samples is 17,280 per instance
HOT_BLOCKS = 20
SAMPLE_S = 5.0  # the conductor's default sampling interval: no finer buckets than that
GAUGES = (
    "queue_depth",
    "running",
    "kv_blocks_used",
    "kv_blocks_free",
    "kv_blocks_cached",
    "disk_blocks_used",
    "disk_blocks_free",
)


# -- SQL ------------------------------------------------------------------------------
async def read_samples(conn: AsyncConnection, since: float | None) -> list[dict[str, Any]]:
    """Load samples in the window, oldest first (the newest MAX_SAMPLES at most)."""
    t = LoadSample.__table__
    query = select(t).order_by(t.c.t.desc()).limit(MAX_SAMPLES)
    if since is not None:
        query = query.where(t.c.t >= since)
    return [dict(r._mapping) for r in reversed((await conn.execute(query)).all())]


async def read_kv(conn: AsyncConnection) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(blocks per instance and tier, the hottest blocks with their replicas)."""
    t = KVBlockRecord.__table__
    tiers = [
        {"instance": i, "tier": tier, "blocks": n, "nbytes": int(b or 0), "hits": int(h or 0)}
        for i, tier, n, b, h in await conn.execute(
            select(
                t.c.instance_id,
                t.c.tier,
                func.count(),
                func.sum(t.c.nbytes),
                func.sum(t.c.hit_count),
            )
            .group_by(t.c.instance_id, t.c.tier)
            .order_by(t.c.instance_id, t.c.tier)
        )
    ]
    hits, replicas = func.sum(t.c.hit_count).label("hits"), func.count().label("replicas")
    top = (
        await conn.execute(
            select(
                t.c.block_hash,
                hits,
                replicas,
                func.count(func.distinct(t.c.instance_id)),
                func.max(t.c.last_access),
            )
            .group_by(t.c.block_hash)
            .order_by(hits.desc(), replicas.desc(), t.c.block_hash)
            .limit(HOT_BLOCKS)
        )
    ).all()
    holders: dict[int, list[str]] = {}
    if top:
        for h, inst, tier in await conn.execute(
            select(t.c.block_hash, t.c.instance_id, t.c.tier)
            .where(t.c.block_hash.in_([row[0] for row in top]))
            .order_by(t.c.instance_id, t.c.tier)
        ):
            holders.setdefault(h, []).append(f"{inst}/{tier}")
    hot = [
        {
            "block": f"{from_signed(h):016x}",
            "hits": int(n_hits),
            "replicas": n,
            "instances": n_inst,
            "holders": ", ".join(holders.get(h, [])),
            "last_access": last,
        }
        for h, n_hits, n, n_inst, last in top
    ]
    return tiers, hot


async def read_decision(conn: AsyncConnection, request_id: str) -> dict[str, Any] | None:
    t = DecisionRecord.__table__
    row = (await conn.execute(select(t).where(t.c.request_id == request_id))).first()
    return None if row is None else dict(row._mapping)


# -- series ---------------------------------------------------------------------------
def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _total(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def load_series(samples: list[dict[str, Any]], bucket_s: float) -> dict[str, dict[str, Any]]:
    """Per instance: bucket starts, the mean of each gauge and the sum of each activity count
    per bucket (None where nothing was measured)."""
    groups: dict[str, dict[float, list[dict[str, Any]]]] = {}
    roles: dict[str, str] = {}
    for s in samples:
        start = math.floor(s["t"] / bucket_s) * bucket_s
        groups.setdefault(s["instance_id"], {}).setdefault(start, []).append(s)
        roles[s["instance_id"]] = s["role"]
    out: dict[str, dict[str, Any]] = {}
    for inst in sorted(groups, key=lambda i: (roles[i] != "prefill", i)):
        buckets = dict(sorted(groups[inst].items()))
        series: dict[str, Any] = {"role": roles[inst], "t": list(buckets)}
        for key in GAUGES:
            series[key] = [_mean(s[key] for s in g) for g in buckets.values()]
        for key in ACTIVITY:
            series[key] = [_total(s[key] for s in g) for g in buckets.values()]
        out[inst] = series
    return out


def has_disk(series: dict[str, dict[str, Any]]) -> bool:
    return any(
        v
        for s in series.values()
        for key in ("disk_blocks_used", "disk_blocks_free", "disk_stored")
        for v in s[key]
    )


def activity_totals(samples: list[dict[str, Any]]) -> dict[str, int]:
    """Each activity count summed over the window, all instances."""
    return {key: sum(s[key] or 0 for s in samples) for key in ACTIVITY}


def candidates_table(decision: dict[str, Any]) -> list[dict[str, Any]]:
    """The conductor's candidates for one request, best predicted TTFT first, chosen marked."""
    chosen = decision.get("prefill_instance")
    rows = [
        {"chosen": c.get("instance") == chosen, **c}
        for c in decision.get("candidates") or []
        if isinstance(c, dict)
    ]
    return sorted(rows, key=lambda r: (not r["chosen"], r.get("ttft_ms") or math.inf))


def decision_summary(decision: dict[str, Any], row: dict[str, Any]) -> str:
    """One line: where the conductor put the request and why, against what was measured."""
    policy = decision.get("policy") or "?"
    if decision.get("rejected"):
        return f"Rejected by policy {policy}: {decision['rejected']}"
    parts = [f"Placed by policy {policy} on prefill {decision.get('prefill_instance') or '?'}"]
    if decision.get("decode_instance"):
        parts.append(f"decode {decision['decode_instance']}")
    text = ", ".join(parts)
    predicted = decision.get("predicted_ttft_ms")
    if predicted is not None:
        text += f"; predicted TTFT {predicted:,.0f} ms"
        if row.get("ttft_ms") is not None:
            text += f", measured {row['ttft_ms']:,.0f} ms"
    if decision.get("predicted_tbt_ms") is not None:
        text += f"; predicted TBT {decision['predicted_tbt_ms']:,.1f} ms"
    return text
