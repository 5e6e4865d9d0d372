"""Planner: the prefill/decode split over time with the switches marked, the planner's
decisions that switched (or would have), and the role switches with how they ended."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from console import charts, planner, queries
from console.planner import PlannerData
from console.view import View, chart, pct, plain, when


def planner_page(view: View) -> None:
    if view.snap is None:
        st.info("No planner record without the database.")
        return
    data = view.planner
    if data is None:
        return  # View.planner said why
    _latest(data)
    _split(view, data)
    _decisions(data)
    _switches(data)


def _latest(data: PlannerData) -> None:
    d = data.latest
    if d is None:
        return
    cols = st.columns(5)
    cols[0].metric("Planner mode", d["mode"])
    cols[1].metric("Split now", f"{d['current_prefill']}P:{d['current_decode']}D")
    cols[2].metric("Best split", f"{d['best_prefill']}P:{d['best_decode']}D")
    cols[3].metric(
        "SLO attainment", pct(d.get("attainment")), help="as the planner measured its window"
    )
    cols[4].metric("Last decision", f"{max(data.now - d['created'], 0.0):,.0f} s ago")
    switch = planner.switch_text(d)
    if switch:
        switch = f" Switch: {switch} ({'sent' if d['acted'] else 'not sent'})."
    st.caption(plain(f"Latest reason: {d.get('reason') or '—'}.{switch}"))


def _split(view: View, data: PlannerData) -> None:
    st.subheader("Prefill/decode split")
    if data.splits:
        span = queries.time_range(view.window_s, data.splits, data.now, key="created")
        steps = planner.split_steps(data.splits)
        chart(charts.split_over_time(steps, planner.switch_marks(data), span), "plan_split")
        st.caption(
            "Solid: instances ready in each role as the planner counted them (switching "
            "ones left out); dotted: the split it predicted best. Marks: role switches "
            "asked for (filled) and switches the planner would have made (open)."
        )
        return
    st.info(planner.NO_DECISIONS if data.latest is None else "No planner decisions in this window.")
    found = view.load_history
    if found is not None:
        assert view.snap is not None
        _, bucket, span = found
        series = planner.roles_from_samples(view.snap.samples, bucket)
        chart(charts.roles_over_time(series, bucket, span), "plan_roles")


def _decisions(data: PlannerData) -> None:
    st.subheader("Decisions that switched, or would have")
    if not data.notable:
        st.caption("None in this window: each decision found the split it saw best.")
        return
    rows = planner.decision_rows(data.notable)
    frame = pd.DataFrame(rows).assign(created=[when(r["created"]) for r in rows])
    st.dataframe(frame, hide_index=True)
    st.caption(
        f"Newest {planner.TABLE_ROWS} at most. Goodput: requests/s predicted to meet both "
        "SLOs under the planner's forecast, for the split it saw and for the best one."
    )


def _switches(data: PlannerData) -> None:
    st.subheader("Role switches")
    if not data.switches:
        st.caption(
            "None in this window. An admin asks for one through the gateway's admin API or "
            "`halfmoon instances set-role`; the planner does in active mode."
        )
        return
    rows = planner.switch_rows(data.switches)
    frame = pd.DataFrame(rows).assign(
        requested_at=[when(r["requested_at"]) for r in rows],
        finished_at=[when(r["finished_at"]) for r in rows],
    )
    st.dataframe(frame, hide_index=True)
