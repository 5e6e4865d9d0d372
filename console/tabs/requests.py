"""Requests: the window's requests, filtered by status and instance, and one request's
timeline with the conductor's reasons for its placement."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from console import charts, history, queries
from console.view import View, chart, plain, when

TABLE_ROWS = 1000  # newest rows shown in the Requests table


def kib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 1024, 1)


def _table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "id": r["id"],
                "status": r["status"],
                "arrival": when(r["arrival_time"]),
                "ttft_ms": r.get("ttft_ms"),
                "e2e_ms": r.get("e2e_ms"),
                "prompt_tokens": r.get("prompt_tokens"),
                "cached_tokens": r.get("cached_tokens"),
                "completion_tokens": r.get("completion_tokens"),
                # The handoff's KV moved, and the prompt decode held already (reuse).
                "handoff_kib": kib(r.get("handoff_bytes")),
                "decode_held_tokens": r.get("handoff_held_tokens"),
                "prefill": r.get("prefill_instance"),
                "decode": r.get("decode_instance"),
                "finish_reason": r.get("finish_reason"),
                "error": r.get("error"),
            }
            for r in rows[:TABLE_ROWS]
        ]
    )


def requests_page(view: View) -> None:
    if view.snap is None:
        st.info("No request history without the database.")
        return
    rows = view.snap.requests
    instances = sorted(
        {r[k] for r in rows for k in ("prefill_instance", "decode_instance") if r.get(k)}
    )
    left, right = st.columns(2)
    statuses = left.multiselect(
        "Status", queries.STATUSES, default=queries.STATUSES, key="req_status"
    )
    instance = right.selectbox("Instance", ["any", *instances], key="req_instance")
    chosen = queries.filter_requests(rows, statuses, None if instance == "any" else instance)
    st.caption(
        f"{len(chosen):,} requests match; the newest {min(len(chosen), TABLE_ROWS):,} are shown."
    )
    if not chosen:
        return
    st.dataframe(_table(chosen), hide_index=True)
    by_id = {r["id"]: r for r in chosen[:TABLE_ROWS]}
    picked = st.selectbox("Request timeline", list(by_id), key="req_id")
    if picked in by_id:
        _request_detail(view, by_id[picked])


def _request_detail(view: View, row: dict[str, Any]) -> None:
    rid = row["id"]
    chart(charts.request_timeline(queries.request_timeline(row), rid), "req_timeline")
    st.caption(
        "Phase boundaries as the gateway saw them: the placement reply, the first token, "
        "the first token from the decode instance (so the handoff includes one decode "
        "step), the last token. Phases not measured for this request are left out."
    )
    if row.get("error"):
        st.code(row["error"])
    try:
        decision = view.decision(rid)
    except queries.DatabaseUnavailable as exc:
        st.error(f"Database unreachable: {exc}")
        return
    if decision is None:
        st.info("The conductor recorded no decision for this request.")
        return
    st.markdown(f"**Placement.** {plain(history.decision_summary(decision, row))}")
    candidates = history.candidates_table(decision)
    if candidates:
        st.dataframe(pd.DataFrame(candidates), hide_index=True)
        chart(charts.candidate_costs(candidates, rid), "req_candidates_chart")
