"""Overview: the window's request counts, latency percentiles, SLO attainment and hit
rate, and requests and TTFT over time."""

from __future__ import annotations

import streamlit as st

from console import charts, queries
from console.view import View, chart, ms, pct


def overview_page(view: View) -> None:
    if view.snap is None:
        st.info("No request data without the database.")
        return
    rows = view.snap.requests
    m = queries.overview(rows, view.snap.now, view.window_s, view.slo_ms)
    cols = st.columns(6)
    cols[0].metric("Requests", f"{m['requests']:,}")
    cols[1].metric("Requests/s", f"{m['requests_per_s']:.3f}")
    cols[2].metric("TTFT p50", ms(m["ttft_p50_ms"]))
    cols[3].metric("TTFT p99", ms(m["ttft_p99_ms"]))
    cols[4].metric(
        "SLO attainment",
        pct(m["slo_attainment"]),
        help=f"completed with TTFT ≤ {view.slo_ms:g} ms, over completed + failed + "
        "rejected (cancelled requests are left out)",
    )
    cols[5].metric("Rejection rate", pct(m["rejection_rate"]))
    cols = st.columns(6)
    cols[0].metric("TBT p50", ms(m["tbt_p50_ms"]), help="mean gap between output tokens")
    cols[1].metric("TBT p99", ms(m["tbt_p99_ms"]))
    cols[2].metric("E2E p50", ms(m["e2e_p50_ms"]))
    cols[3].metric("E2E p99", ms(m["e2e_p99_ms"]))
    cols[4].metric("KV hit rate", pct(m["hit_rate"]), help="cached / prompt tokens, completed")
    cols[5].metric("Failed", f"{m['counts'].get('failed', 0):,}")
    if view.snap.truncated:
        st.caption(f"Only the newest {queries.MAX_ROWS:,} requests of this window are counted.")
    if not rows:
        st.info("No requests in this time window.")
        return
    bucket = queries.bucket_seconds(view.window_s, rows, view.snap.now)
    span = queries.time_range(view.window_s, rows, view.snap.now)
    status = queries.status_series(rows, bucket)
    chart(charts.requests_by_status(status, bucket, span), "ov_status")
    chart(charts.ttft_over_time(queries.ttft_series(rows, bucket), view.slo_ms, span), "ov_ttft")
