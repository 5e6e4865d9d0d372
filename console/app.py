"""Halfmoon operations console: `streamlit run console/app.py` (or `halfmoon serve console`).

Layout only: data comes from console.queries (SQL, read-only) and console.live (the
gateway's admin JSON); figures from console.charts. Every page is drawn on every run
(tabs), inside one fragment that Streamlit reruns every HALFMOON_CONSOLE_REFRESH_S seconds.
"""

from __future__ import annotations

import hmac
import sys
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

# Streamlit puts this file's folder on sys.path, not the repository root.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from console import charts, history, live, queries  # noqa: E402

SETTINGS = queries.ConsoleSettings.from_env()
TABLE_ROWS = 1000  # newest rows shown in the Requests table


# Load samples bucketed per instance: (series, bucket seconds, x range).
History = tuple[dict[str, dict[str, Any]], float, tuple[float, float]]


@dataclass
class View:
    """What every page gets: one SQL snapshot, one live state, the sidebar choices."""

    snap: queries.Snapshot | None
    cluster: dict[str, Any] | None
    window_s: float | None
    slo_ms: float

    @cached_property
    def load_history(self) -> History | None:
        """Bucketed once per refresh for both the Pools and the KV cache page."""
        samples = self.snap.samples if self.snap is not None else []
        if not samples:
            return None
        now = self.snap.now  # type: ignore[union-attr]
        bucket = queries.bucket_seconds(
            self.window_s, samples, now, key="t", finest=history.SAMPLE_S
        )
        return (
            history.load_series(samples, bucket),
            bucket,
            queries.time_range(self.window_s, samples, now, key="t"),
        )


# -- data, with the two failure messages ------------------------------------------------
@st.cache_data(ttl=1, show_spinner=False)
def _snapshot(url: str, window_s: float | None) -> queries.Snapshot:
    return queries.load_snapshot(url, window_s)


def _load_snapshot(window_s: float | None) -> queries.Snapshot | None:
    try:
        return _snapshot(SETTINGS.database_url, window_s)
    except queries.DatabaseUnavailable as exc:
        st.error(f"Database unreachable: {exc}")
        return None


@st.cache_data(ttl=1, show_spinner=False)
def _decision(url: str, request_id: str) -> dict[str, Any] | None:
    return queries.load_decision(url, request_id)


def _load_cluster() -> dict[str, Any] | None:
    try:
        return live.fetch_state(SETTINGS.gateway_url, admin_key=SETTINGS.admin_key)
    except live.ClusterUnavailable as exc:
        st.warning(
            f"Cluster unreachable at {live.admin_url(SETTINGS.gateway_url)} ({exc}); "
            "instance data below comes from SQL."
        )
        return None


# -- formatting -----------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} ms"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts)


def _plain(text: str) -> str:
    """Text shown literally inside markdown (ids and reasons may hold *, _, $ ...)."""
    return "".join("\\" + c if c in "\\`*_[]<>$~|#" else c for c in text)


def _chart(fig: Any, key: str) -> None:
    st.plotly_chart(fig, key=key, width="stretch")


# -- pages ----------------------------------------------------------------------------
def overview_page(view: View) -> None:
    if view.snap is None:
        st.info("No request data without the database.")
        return
    rows = view.snap.requests
    m = queries.overview(rows, view.snap.now, view.window_s, view.slo_ms)
    cols = st.columns(6)
    cols[0].metric("Requests", f"{m['requests']:,}")
    cols[1].metric("Requests/s", f"{m['requests_per_s']:.3f}")
    cols[2].metric("TTFT p50", _ms(m["ttft_p50_ms"]))
    cols[3].metric("TTFT p99", _ms(m["ttft_p99_ms"]))
    cols[4].metric(
        "SLO attainment",
        _pct(m["slo_attainment"]),
        help=f"completed with TTFT ≤ {view.slo_ms:g} ms, over completed + failed + "
        "rejected (cancelled requests are left out)",
    )
    cols[5].metric("Rejection rate", _pct(m["rejection_rate"]))
    cols = st.columns(6)
    cols[0].metric("TBT p50", _ms(m["tbt_p50_ms"]), help="mean gap between output tokens")
    cols[1].metric("TBT p99", _ms(m["tbt_p99_ms"]))
    cols[2].metric("E2E p50", _ms(m["e2e_p50_ms"]))
    cols[3].metric("E2E p99", _ms(m["e2e_p99_ms"]))
    cols[4].metric("KV hit rate", _pct(m["hit_rate"]), help="cached / prompt tokens, completed")
    cols[5].metric("Failed", f"{m['counts'].get('failed', 0):,}")
    if view.snap.truncated:
        st.caption(f"Only the newest {queries.MAX_ROWS:,} requests of this window are counted.")
    if not rows:
        st.info("No requests in this time window.")
        return
    bucket = queries.bucket_seconds(view.window_s, rows, view.snap.now)
    span = queries.time_range(view.window_s, rows, view.snap.now)
    status = queries.status_series(rows, bucket)
    _chart(charts.requests_by_status(status, bucket, span), "ov_status")
    _chart(charts.ttft_over_time(queries.ttft_series(rows, bucket), view.slo_ms, span), "ov_ttft")


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
    _chart(charts.pool_load(rows), "pool_load")


def _history(view: View) -> History | None:
    """The window's load history, or None after saying why there is none."""
    if view.load_history is None:
        st.info(
            "No load samples in this time window: the conductor writes one per instance "
            "every few seconds (load_samples table)."
            if view.snap is not None
            else "No load history without the database."
        )
    return view.load_history


def _pool_history(view: View) -> None:
    st.subheader("Load over time")
    found = _history(view)
    if found is None:
        return
    series, bucket, span = found
    st.caption(f"Per instance, mean of the conductor's samples in each {bucket:g} s.")
    left, right = st.columns(2)
    with left:
        _chart(
            charts.over_time(
                series, {"queue_depth": "queued"}, "Queue depth over time", "requests", span
            ),
            "pool_queue_t",
        )
    with right:
        _chart(
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
            _chart(
                charts.over_time(
                    series,
                    {f"{key}_used": "used", f"{key}_free": "free"},
                    f"KV blocks over time, {tier} tier",
                    "blocks",
                    span,
                ),
                f"pool_{key}_t",
            )


def kv_page(view: View) -> None:
    if view.snap is None:
        st.info("No KV statistics without the database.")
        return
    _hit_rates(view)
    _cache_contents(view)
    _kv_activity(view)


def _hit_rates(view: View) -> None:
    assert view.snap is not None
    rows = view.snap.requests
    now = view.snap.now
    series = queries.hit_rate_series(rows, queries.bucket_seconds(view.window_s, rows, now))
    names = list(series["per_instance"])
    cols = st.columns(max(len(names) + 1, 1))
    cols[0].metric("Cluster hit rate", _pct(queries.hit_rate(rows)))
    for col, name in zip(cols[1:], names):
        mine = [r for r in rows if r.get("prefill_instance") == name]
        col.metric(f"{name} hit rate", _pct(queries.hit_rate(mine)))
    if not series["t"]:
        st.info("No completed requests in this time window.")
        return
    _chart(
        charts.hit_rate_over_time(series, queries.time_range(view.window_s, rows, now)), "kv_hits"
    )


def _cache_contents(view: View) -> None:
    assert view.snap is not None
    st.subheader("Hottest prefixes")
    hot = view.snap.hot_blocks
    if not hot:
        st.info("The KV manager has recorded no cached blocks (kv_blocks table).")
        return
    st.caption(
        "A block's hash names its whole prefix (hashes are chained). Hits: placements "
        "that reused the block (counted on the instance with the longest match); "
        "replicas: its (instance, tier) copies."
    )
    frame = pd.DataFrame(hot).assign(last_access=[_when(h["last_access"]) for h in hot])
    st.dataframe(frame, hide_index=True)
    _chart(charts.kv_blocks_by_tier(view.snap.kv_tiers), "kv_tiers")


def _kv_activity(view: View) -> None:
    st.subheader("Evictions and transfers over time")
    found = _history(view)
    if found is None:
        return
    series, bucket, span = found
    totals = history.activity_totals(view.snap.samples)  # type: ignore[union-attr]
    cols = st.columns(5)
    cols[0].metric("Blocks stored", f"{totals['blocks_stored']:,}")
    cols[1].metric("Blocks evicted", f"{totals['blocks_evicted']:,}")
    cols[2].metric("Transfers in", f"{totals['transfers_in']:,}")
    cols[3].metric("Transfers out", f"{totals['transfers_out']:,}")
    cols[4].metric(
        "MiB transferred",
        f"{(totals['bytes_in']) / 2**20:,.1f}",
        help="fetched by instances (in); what they served (out) is the same traffic",
    )
    churn = {"blocks_stored": "stored", "blocks_evicted": "evicted"}
    if history.has_disk(series):
        churn.update({"disk_stored": "to disk", "disk_removed": "off disk"})
    _chart(
        charts.over_time(
            series, churn, f"KV blocks stored and evicted per {bucket:g} s", "blocks", span
        ),
        "kv_evictions_t",
    )
    left, right = st.columns(2)
    with left:
        _chart(
            charts.over_time(
                series,
                {"transfers_in": "in", "transfers_out": "out"},
                f"KV transfers per {bucket:g} s",
                "transfers",
                span,
            ),
            "kv_transfers_t",
        )
    with right:
        _chart(
            charts.over_time(
                series,
                {"bytes_in": "in", "bytes_out": "out"},
                f"KV MiB transferred per {bucket:g} s",
                "MiB",
                span,
                1 / 2**20,
            ),
            "kv_bytes_t",
        )


def _table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "id": r["id"],
                "status": r["status"],
                "arrival": _when(r["arrival_time"]),
                "ttft_ms": r.get("ttft_ms"),
                "e2e_ms": r.get("e2e_ms"),
                "prompt_tokens": r.get("prompt_tokens"),
                "cached_tokens": r.get("cached_tokens"),
                "completion_tokens": r.get("completion_tokens"),
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
        _request_detail(by_id[picked])


def _request_detail(row: dict[str, Any]) -> None:
    rid = row["id"]
    _chart(charts.request_timeline(queries.request_timeline(row), rid), "req_timeline")
    st.caption(
        "Phase boundaries as the gateway saw them: the placement reply, the first token, "
        "the first token from the decode instance (so the handoff includes one decode "
        "step), the last token. Phases not measured for this request are left out."
    )
    if row.get("error"):
        st.code(row["error"])
    try:
        decision = _decision(SETTINGS.database_url, rid)
    except queries.DatabaseUnavailable as exc:
        st.error(f"Database unreachable: {exc}")
        return
    if decision is None:
        st.info("The conductor recorded no decision for this request.")
        return
    st.markdown(f"**Placement.** {_plain(history.decision_summary(decision, row))}")
    candidates = history.candidates_table(decision)
    if candidates:
        st.dataframe(pd.DataFrame(candidates), hide_index=True)
        _chart(charts.candidate_costs(candidates, rid), "req_candidates_chart")


def _report_table(name: str, rows: list[dict[str, Any]]) -> None:
    st.subheader(name)
    frame = pd.DataFrame(rows)
    st.dataframe(frame, hide_index=True)
    numeric = [
        c
        for c in frame.columns
        if pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
    ]
    labels = [c for c in frame.columns if c not in numeric]
    if numeric and labels:
        metric = st.selectbox(f"Plot a column of {name}", numeric, key=f"report_col_{name}")
        _chart(charts.report_bars(rows, labels[0], metric), f"report_{name}")


def benchmarks_page(view: View) -> None:
    path = st.text_input("Replay report (JSON or JSON Lines path)", key="report_path").strip()
    if not path:
        st.info("Enter the path of a benchmark or replay report to show its numbers.")
        return
    try:
        report = queries.load_report(path)
    except (OSError, ValueError) as exc:
        st.error(f"Cannot read report {path}: {exc}")
        return
    metrics, tables = queries.report_sections(report)
    if not metrics and not tables:
        st.info("The report has no numbers or tables this page can show.")
    for start in range(0, len(metrics), 4):
        cols = st.columns(4)
        for col, (key, value) in zip(cols, list(metrics.items())[start : start + 4]):
            col.metric(key, f"{value:,.4g}")
    for name, rows in tables.items():
        _report_table(name, rows)


PAGES = {
    "Overview": overview_page,
    "Pools": pools_page,
    "KV cache": kv_page,
    "Requests": requests_page,
    "Benchmarks": benchmarks_page,
}


# -- layout ---------------------------------------------------------------------------
@st.fragment(run_every=SETTINGS.refresh_s)
def pages(window_label: str, slo_ms: float) -> None:
    view = View(
        _load_snapshot(queries.WINDOWS[window_label]),
        _load_cluster(),
        queries.WINDOWS[window_label],
        slo_ms,
    )
    for tab, (name, page) in zip(st.tabs(list(PAGES)), PAGES.items()):
        with tab:
            try:
                page(view)
            except Exception as exc:  # noqa: BLE001 - one broken page must not blank the rest
                st.error(f"The {name} page failed: {type(exc).__name__}: {exc}")


def admitted() -> bool:
    """Beyond loopback the console shows nothing until the visitor types the admin key:
    it reads every request record and the cluster's admin JSON."""
    if not SETTINGS.needs_login or st.session_state.get("admitted"):
        return True
    st.title("Halfmoon console")
    if not SETTINGS.admin_key:
        st.error(
            f"This console listens on {SETTINGS.host}, beyond this machine, and has no "
            "admin key to check visitors against: set HALFMOON_ADMIN_KEY or "
            "HALFMOON_ADMIN_KEY_FILE, or bind it to 127.0.0.1."
        )
        return False
    given = st.text_input("Admin key", type="password", key="login_key")
    if not given:
        st.info("Enter the cluster's admin key to continue.")
        return False
    if not hmac.compare_digest(given.strip().encode(), SETTINGS.admin_key.encode()):
        st.error("That is not the admin key.")
        return False
    st.session_state["admitted"] = True
    st.rerun()  # draw the console without the login form
    return True


def main() -> None:
    st.set_page_config(page_title="Halfmoon console", layout="wide")
    if not admitted():
        return
    st.sidebar.title("Halfmoon")
    window = st.sidebar.selectbox("Time window", list(queries.WINDOWS), index=1, key="window")
    slo_ms = st.sidebar.number_input(
        "TTFT SLO (ms)", min_value=1, value=2000, step=100, key="slo_ms"
    )
    st.sidebar.caption(f"Database: {queries.safe_url(SETTINGS.database_url)}")
    st.sidebar.caption(f"Gateway: {SETTINGS.gateway_url}")
    st.sidebar.caption(f"Refresh every {SETTINGS.refresh_s:g} s")
    pages(window, float(slo_ms))


main()
