"""Pools: each prefill and decode instance now (live from the gateway, else from SQL),
and their load over the window from the conductor's samples."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from console import charts, history, live
from console.view import View, chart, history_or_note


def _pool_rows(view: View) -> tuple[list[dict[str, Any]], str, float] | None:
    """Rows, where they came from, and after how many silent seconds an instance is dead."""
    if view.cluster is not None:
        c = view.cluster
        source = (
            f"Live from gateway {c.get('gateway', '?')}: {c.get('in_flight', 0)} requests in flight"
        )
        return live.pool_from_live(c), source, live.DEAD_AFTER_S
    if view.snap is not None:
        return (
            live.pool_from_sql(view.snap.instances, view.snap.now),
            "From SQL (instances table)",
            live.SQL_STALE_AFTER_S,
        )
    return None


def _dead_red(row: pd.Series) -> list[str]:
    style = "background-color: rgba(214, 39, 40, 0.25)" if row["health"] == "DEAD" else ""
    return [style] * len(row)


def pools_page(view: View) -> None:
    _pool_tables(view)
    _pool_history(view)


def _pool_tables(view: View) -> None:
    found = _pool_rows(view)
    if found is None:
        st.info("No instance data: neither the gateway nor the database answered.")
        return
    rows, source, dead_after_s = found
    st.caption(source)
    if not rows:
        st.info("No prefill or decode instance has been seen.")
        return
    dead = [r["instance"] for r in rows if r["health"] == "DEAD"]
    if dead:
        st.warning(
            f"Dead instances: {', '.join(dead)} (no heartbeat for "
            f"{dead_after_s:g} s, or marked dead)"
        )
    for role in live.POOL_ROLES:
        part = [r for r in rows if r["role"] == role]
        st.subheader(f"{role.capitalize()} pool ({len(part)})")
        if part:
            styled = pd.DataFrame(part).style.apply(_dead_red, axis=1).format(precision=1)
            st.dataframe(styled, hide_index=True)
    chart(charts.pool_load(rows), "pool_load")


def _pool_history(view: View) -> None:
    st.subheader("Load over time")
    found = history_or_note(view)
    if found is None:
        return
    series, bucket, span = found
    st.caption(f"Per instance, mean of the conductor's samples in each {bucket:g} s.")
    left, right = st.columns(2)
    with left:
        chart(
            charts.over_time(
                series, {"queue_depth": "queued"}, "Queue depth over time", "requests", span
            ),
            "pool_queue_t",
        )
    with right:
        chart(
            charts.over_time(
                series, {"running": "running"}, "Running batch over time", "sequences", span
            ),
            "pool_running_t",
        )
    tiers = [("DRAM", "kv_blocks")]
    if history.has_disk(series):
        tiers.append(("disk", "disk_blocks"))
    for col, (tier, key) in zip(st.columns(len(tiers)), tiers):
        with col:
            chart(
                charts.over_time(
                    series,
                    {f"{key}_used": "used", f"{key}_free": "free"},
                    f"KV blocks over time, {tier} tier",
                    "blocks",
                    span,
                ),
                f"pool_{key}_t",
            )
