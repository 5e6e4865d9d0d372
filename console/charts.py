"""Figure builders: plain data in, a plotly figure out. No I/O, no Streamlit.

Values go in as Python lists (never numpy arrays) so the figure JSON keeps readable
arrays rather than plotly's base64 typed arrays; times go in as unix seconds and come
out as local datetimes on the x axis.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import plotly.colors
import plotly.graph_objects as go

STATUS_COLORS = {
    "completed": "#2ca02c",
    "running": "#1f77b4",
    "queued": "#9ecae1",
    "failed": "#d62728",
    "rejected": "#ff7f0e",
    "cancelled": "#7f7f7f",
}
DEAD_COLOR = "#d62728"
PALETTE = plotly.colors.qualitative.Plotly
DASHES = ("solid", "dot", "dash", "dashdot")


def _times(ts: list[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t) for t in ts]


def _layout(
    fig: go.Figure, title: str, x: str, y: str, x_range: tuple[float, float] | None = None
) -> go.Figure:
    # A fixed time axis keeps one lonely bucket from zooming the axis to milliseconds.
    if x_range is not None:
        fig.update_xaxes(range=_times(list(x_range)))
    fig.update_layout(
        title=title,
        xaxis_title=x,
        yaxis_title=y,
        legend_title_text="",
        margin={"l": 40, "r": 20, "t": 50, "b": 40},
    )
    return fig


def requests_by_status(
    series: dict[str, Any], bucket_s: float, x_range: tuple[float, float] | None = None
) -> go.Figure:
    # Each bar covers its interval: centred on the middle, as wide as the bucket (axis in ms).
    mid = _times([t + bucket_s / 2 for t in series["t"]])
    fig = go.Figure(
        [
            go.Bar(
                name=status,
                x=mid,
                y=list(counts),
                width=900.0 * bucket_s,
                marker_color=STATUS_COLORS.get(status),
            )
            for status, counts in series["by_status"].items()
        ]
    )
    fig.update_layout(barmode="stack")
    return _layout(fig, f"Requests per {bucket_s:g} s by status", "arrival", "requests", x_range)


def ttft_over_time(
    series: dict[str, Any], slo_ms: float, x_range: tuple[float, float] | None = None
) -> go.Figure:
    x = _times(series["t"])
    fig = go.Figure(
        [
            go.Scatter(name="TTFT p50", x=x, y=list(series["p50"]), mode="lines+markers"),
            go.Scatter(name="TTFT p99", x=x, y=list(series["p99"]), mode="lines+markers"),
        ]
    )
    fig.add_hline(
        y=slo_ms, line_dash="dash", line_color=DEAD_COLOR, annotation_text=f"SLO {slo_ms:g} ms"
    )
    return _layout(fig, "Time to first token", "arrival", "ms", x_range)


def pool_load(rows: list[dict[str, Any]]) -> go.Figure:
    """Queue depth and running per instance; dead instances get a marked name and red edges."""
    names = [r["instance"] + (" (DEAD)" if r["health"] == "DEAD" else "") for r in rows]
    edges = [DEAD_COLOR if r["health"] == "DEAD" else "rgba(0,0,0,0)" for r in rows]
    fig = go.Figure(
        [
            go.Bar(
                name="queue depth",
                x=names,
                y=[r["queue_depth"] for r in rows],
                marker={"line": {"color": edges, "width": 3}},
            ),
            go.Bar(
                name="running",
                x=names,
                y=[r["running"] for r in rows],
                marker={"line": {"color": edges, "width": 3}},
            ),
        ]
    )
    fig.update_layout(barmode="group")
    return _layout(fig, "Load per instance", "instance", "requests")


def hit_rate_over_time(
    series: dict[str, Any], x_range: tuple[float, float] | None = None
) -> go.Figure:
    """Token-weighted KV hit rate in percent: the cluster, then each prefill instance."""
    x = _times(series["t"])
    pct = lambda vs: [None if v is None else 100.0 * v for v in vs]  # noqa: E731
    traces = [
        go.Scatter(
            name="cluster",
            x=x,
            y=pct(series["cluster"]),
            mode="lines+markers",
            line={"width": 4},
            connectgaps=True,
        )
    ]
    traces += [
        go.Scatter(name=name, x=x, y=pct(values), mode="lines+markers", connectgaps=True)
        for name, values in series["per_instance"].items()
    ]
    fig = go.Figure(traces)
    fig.update_yaxes(range=[0, 100])
    return _layout(fig, "KV cache hit rate (cached / prompt tokens)", "arrival", "%", x_range)


def request_timeline(segments: list[dict[str, Any]], request_id: str) -> go.Figure:
    """One horizontal bar per phase, placed on a milliseconds-since-arrival axis."""
    fig = go.Figure(
        [
            go.Bar(
                name=s["phase"],
                y=[s["phase"]],
                x=[s["end_ms"] - s["start_ms"]],
                base=[s["start_ms"]],
                orientation="h",
            )
            for s in segments
        ]
    )
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"Timeline of {request_id}", "ms since arrival", "")


def over_time(
    series: dict[str, dict[str, Any]],
    fields: dict[str, str],
    title: str,
    y: str,
    x_range: tuple[float, float] | None = None,
    scale: float = 1.0,
) -> go.Figure:
    """One line per instance and field (console.history.load_series): an instance keeps its
    colour, the first field is solid, the next dotted. `fields` maps a key to its label."""
    traces = []
    for i, (inst, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        for dash, (key, label) in zip(DASHES, fields.items()):
            traces.append(
                go.Scatter(
                    name=inst if len(fields) == 1 else f"{inst} {label}",
                    x=_times(s["t"]),
                    y=[None if v is None else v * scale for v in s[key]],
                    mode="lines+markers",
                    line={"color": color, "dash": dash},
                    marker={"size": 4},
                )
            )
    return _layout(go.Figure(traces), title, "time", y, x_range)


def kv_blocks_by_tier(rows: list[dict[str, Any]]) -> go.Figure:
    """Blocks the KV manager knows of, per instance, stacked by tier."""
    instances = sorted({r["instance"] for r in rows})
    tiers = sorted({r["tier"] for r in rows})
    count = {(r["instance"], r["tier"]): r["blocks"] for r in rows}
    fig = go.Figure(
        [
            go.Bar(name=tier, x=instances, y=[count.get((i, tier), 0) for i in instances])
            for tier in tiers
        ]
    )
    fig.update_layout(barmode="stack")
    return _layout(fig, "Cached KV blocks per instance and tier", "instance", "blocks")


def replicated_bytes(
    series: dict[str, Any], bucket_s: float, x_range: tuple[float, float] | None = None
) -> go.Figure:
    """MiB of hot prefixes copied per bucket (console.queries.replication_series), stacked
    by the instance they were copied to; each bar covers its bucket, as requests_by_status."""
    mid = _times([t + bucket_s / 2 for t in series["t"]])
    fig = go.Figure(
        [
            go.Bar(
                name=target,
                x=mid,
                y=[b / 2**20 for b in nbytes],
                width=900.0 * bucket_s,
                marker_color=PALETTE[i % len(PALETTE)],
            )
            for i, (target, nbytes) in enumerate(series["by_target"].items())
        ]
    )
    fig.update_layout(barmode="stack")
    title = f"Hot prefixes replicated: MiB per {bucket_s:g} s by target"
    return _layout(fig, title, "time", "MiB", x_range)


def candidate_costs(rows: list[dict[str, Any]], request_id: str) -> go.Figure:
    """The conductor's predicted TTFT per candidate, split into its parts."""
    names = [str(r.get("instance")) + (" (chosen)" if r.get("chosen") else "") for r in rows]
    parts = (("transfer_ms", "prefix transfer"), ("queue_ms", "queue"), ("prefill_ms", "prefill"))
    fig = go.Figure(
        [
            go.Bar(name=label, y=names, x=[r.get(key) or 0.0 for r in rows], orientation="h")
            for key, label in parts
        ]
    )
    fig.update_layout(barmode="stack", height=max(260, 140 + 40 * len(rows)))
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"Predicted TTFT per candidate for {request_id}", "ms", "")


def report_bars(rows: list[dict[str, Any]], label_key: str, value_key: str) -> go.Figure:
    fig = go.Figure(
        go.Bar(
            x=[str(r.get(label_key)) for r in rows],
            y=[r.get(value_key) for r in rows],
            name=value_key,
        )
    )
    return _layout(fig, value_key, label_key, value_key)


SWITCH_SYMBOLS = {  # role switch marks by status; "advised": the planner would, but did not
    "draining": ("triangle-down", "#1f77b4"),
    "done": ("triangle-down", "#2ca02c"),
    "failed": ("x", DEAD_COLOR),
    "refused": ("x", "#ff7f0e"),
    "advised": ("triangle-down-open", "#7f7f7f"),
}


def split_over_time(
    steps: dict[str, list[Any]],
    marks: list[dict[str, Any]],
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """Prefill and decode instances the planner counted (solid steps) and the split it
    predicted best (dotted), with a mark above the lines where a switch was asked for."""
    x = _times(steps["t"])
    traces = []
    for i, role in enumerate(("prefill", "decode")):
        for key, label, dash in (
            (f"current_{role}", role, "solid"),
            (f"best_{role}", f"best {role}", "dot"),
        ):
            traces.append(
                go.Scatter(
                    name=label,
                    x=x,
                    y=list(steps[key]),
                    mode="lines",
                    line={"shape": "hv", "color": PALETTE[i], "dash": dash},
                )
            )
    top = max((v for k in steps if k != "t" for v in steps[k]), default=0) + 0.5  # marks above
    for kind, (symbol, color) in SWITCH_SYMBOLS.items():
        mine = [m for m in marks if m["kind"] == kind]
        if mine:
            traces.append(
                go.Scatter(
                    name=f"switch {kind}",
                    x=_times([m["t"] for m in mine]),
                    y=[top] * len(mine),
                    mode="markers",
                    marker={"symbol": symbol, "color": color, "size": 11},
                    hovertext=[m["text"] for m in mine],
                    hoverinfo="text+x",
                )
            )
    fig = go.Figure(traces)
    fig.update_yaxes(rangemode="tozero", dtick=_count_tick(top))
    return _layout(fig, "Prefill/decode split over time", "time", "instances", x_range)


def roles_over_time(
    series: dict[str, list[Any]], bucket_s: float, x_range: tuple[float, float] | None = None
) -> go.Figure:
    """Instances per role in each bucket of the load samples (no planner decisions)."""
    fig = go.Figure(
        [
            go.Scatter(
                name=role,
                x=_times(series["t"]),
                y=list(series[role]),
                mode="lines+markers",
                line={"shape": "hv", "color": PALETTE[i]},
            )
            for i, role in enumerate(("prefill", "decode"))
        ]
    )
    fig.update_yaxes(
        rangemode="tozero", dtick=_count_tick(max([*series["prefill"], *series["decode"], 0]))
    )
    title = f"Instances per role, from the load samples ({bucket_s:g} s buckets)"
    return _layout(fig, title, "time", "instances", x_range)


def _count_tick(top: float) -> int | None:
    """Whole instances on the y axis: a tick per instance while they are few (plotly would
    put some at halves), plotly's own above that."""
    return 1 if top <= 12 else None
