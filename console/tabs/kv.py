"""KV cache: hit rates, the hottest cached prefixes, block churn and transfers over the
window, and the hot prefixes the conductor replicated to more prefill instances."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from console import charts, history, queries
from console.view import View, chart, history_or_note, pct, when


def kv_page(view: View) -> None:
    if view.snap is None:
        st.info("No KV statistics without the database.")
        return
    _hit_rates(view)
    _cache_contents(view)
    _kv_activity(view)
    _replications(view)


def _hit_rates(view: View) -> None:
    assert view.snap is not None
    rows = view.snap.requests
    now = view.snap.now
    series = queries.hit_rate_series(rows, queries.bucket_seconds(view.window_s, rows, now))
    names = list(series["per_instance"])
    cols = st.columns(max(len(names) + 1, 1))
    cols[0].metric("Cluster hit rate", pct(queries.hit_rate(rows)))
    for col, name in zip(cols[1:], names):
        mine = [r for r in rows if r.get("prefill_instance") == name]
        col.metric(f"{name} hit rate", pct(queries.hit_rate(mine)))
    if not series["t"]:
        st.info("No completed requests in this time window.")
        return
    chart(
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
    frame = pd.DataFrame(hot).assign(last_access=[when(h["last_access"]) for h in hot])
    st.dataframe(frame, hide_index=True)
    chart(charts.kv_blocks_by_tier(view.snap.kv_tiers), "kv_tiers")


def _kv_activity(view: View) -> None:
    st.subheader("Evictions and transfers over time")
    found = history_or_note(view)
    if found is None or view.snap is None:
        return
    series, bucket, span = found
    totals = history.activity_totals(view.snap.samples)
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
    chart(
        charts.over_time(
            series, churn, f"KV blocks stored and evicted per {bucket:g} s", "blocks", span
        ),
        "kv_evictions_t",
    )
    left, right = st.columns(2)
    with left:
        chart(
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
        chart(
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


def _replications(view: View) -> None:
    assert view.snap is not None
    st.subheader("Replication")
    rows = view.snap.replications
    if rows is None:
        st.info(
            "This database has no replication record (kv_replications table): run the "
            "migrations (`halfmoon db upgrade`)."
        )
        return
    if not rows:
        st.info("No hot prefixes replicated in this time window.")
        return
    st.caption(
        "The conductor copies a prefix that more requests hit than its holders can serve to "
        "another prefill instance. Heat: the prefix's hit rate when copied; holders: the "
        "prefill instances that held it before."
    )
    cols = st.columns(3)
    cols[0].metric("Replications", f"{len(rows):,}")
    cols[1].metric("Blocks replicated", f"{sum(r['blocks'] for r in rows):,}")
    cols[2].metric("MiB replicated", f"{sum(r['nbytes'] for r in rows) / 2**20:,.1f}")
    now = view.snap.now
    bucket = queries.bucket_seconds(view.window_s, rows, now, key="created")
    span = queries.time_range(view.window_s, rows, now, key="created")
    series = queries.replication_series(rows, bucket)
    chart(charts.replicated_bytes(series, bucket, span), "kv_replicated_t")
    table = queries.replication_rows(rows)
    frame = pd.DataFrame(table).assign(time=[when(r["time"]) for r in table])
    st.dataframe(frame, hide_index=True)
