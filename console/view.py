"""What every console page draws from: one `View` per refresh (the SQL snapshot, the live
cluster state, the sidebar's choices), its loaders with their failure messages, and the
small formatting helpers the pages share."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import streamlit as st

from console import history, live, queries
from console.planner import PlannerData
from console.settings import ConsoleSettings

# Load samples bucketed per instance: (series, bucket seconds, x range).
History = tuple[dict[str, dict[str, Any]], float, tuple[float, float]]


@dataclass
class View:
    """What every page gets: one SQL snapshot, one live state, the sidebar choices."""

    snap: queries.Snapshot | None
    cluster: dict[str, Any] | None
    window_s: float | None
    slo_ms: float
    settings: ConsoleSettings

    @classmethod
    def load(cls, settings: ConsoleSettings, window_s: float | None, slo_ms: float) -> View:
        """Read SQL, then the gateway; either may be missing (the pages say so)."""
        snap = _load_snapshot(settings, window_s)
        return cls(snap, _load_cluster(settings), window_s, slo_ms, settings)

    @cached_property
    def load_history(self) -> History | None:
        """Bucketed once per refresh for both the Pools and the KV cache page."""
        if self.snap is None or not self.snap.samples:
            return None
        samples, now = self.snap.samples, self.snap.now
        bucket = queries.bucket_seconds(
            self.window_s, samples, now, key="t", finest=history.SAMPLE_S
        )
        return (
            history.load_series(samples, bucket),
            bucket,
            queries.time_range(self.window_s, samples, now, key="t"),
        )

    @cached_property
    def planner(self) -> PlannerData | None:
        """The planner's record, read apart from the snapshot: a database from before its
        migration (0006) fails the Planner page alone, with the reason."""
        if self.snap is None:
            return None
        try:
            return _planner(self.settings.database_url, self.window_s)
        except queries.DatabaseUnavailable as exc:
            st.error(f"Cannot read the planner's record: {exc}")
            return None

    def decision(self, request_id: str) -> dict[str, Any] | None:
        """The conductor's recorded placement of one request (raises DatabaseUnavailable)."""
        return _decision(self.settings.database_url, request_id)


# -- data, with the two failure messages ------------------------------------------------
@st.cache_data(ttl=1, show_spinner=False)
def _snapshot(url: str, window_s: float | None) -> queries.Snapshot:
    return queries.load_snapshot(url, window_s)


def _load_snapshot(settings: ConsoleSettings, window_s: float | None) -> queries.Snapshot | None:
    try:
        return _snapshot(settings.database_url, window_s)
    except queries.DatabaseUnavailable as exc:
        st.error(f"Database unreachable: {exc}")
        return None


@st.cache_data(ttl=1, show_spinner=False)
def _decision(url: str, request_id: str) -> dict[str, Any] | None:
    return queries.load_decision(url, request_id)


@st.cache_data(ttl=1, show_spinner=False)
def _planner(url: str, window_s: float | None) -> PlannerData:
    return queries.load_planner(url, window_s)


def _load_cluster(settings: ConsoleSettings) -> dict[str, Any] | None:
    try:
        return live.fetch_state(settings.gateway_url, admin_key=settings.admin_key)
    except live.ClusterUnavailable as exc:
        st.warning(
            f"Cluster unreachable at {live.admin_url(settings.gateway_url)} ({exc}); "
            "instance data below comes from SQL."
        )
        return None


def history_or_note(view: View) -> History | None:
    """The window's load history, or None after saying why there is none."""
    if view.load_history is None:
        st.info(
            "No load samples in this time window: the conductor writes one per instance "
            "every few seconds (load_samples table)."
            if view.snap is not None
            else "No load history without the database."
        )
    return view.load_history


# -- formatting -----------------------------------------------------------------------
def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} ms"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts)


def plain(text: str) -> str:
    """Text shown literally inside markdown (ids and reasons may hold *, _, $ ...)."""
    return "".join("\\" + c if c in "\\`*_[]<>$~|#" else c for c in text)


def chart(fig: Any, key: str) -> None:
    st.plotly_chart(fig, key=key, width="stretch")
