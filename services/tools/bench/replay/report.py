"""The replay report: a terminal table, JSON, and an HTML page of plotly charts that works
offline (plotly.js is embedded once)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

ROWS = (  # (label, summary path, format)
    ("requests", ("requests",), "{:.0f}"),
    ("completed", ("completed",), "{:.0f}"),
    ("rejected", ("rejected",), "{:.0f}"),
    ("failed", ("failed",), "{:.0f}"),
    ("throughput req/s", ("throughput_rps",), "{:.2f}"),
    ("output tok/s", ("output_tokens_per_s",), "{:.1f}"),
    ("goodput req/s", ("goodput_rps",), "{:.2f}"),
    ("SLO attainment", ("slo_attainment",), "{:.1%}"),
    ("cache hit ratio", ("cache_hit_ratio",), "{:.1%}"),
    ("ideal hit ratio", ("ideal_hit_ratio",), "{:.1%}"),
    ("TTFT mean ms", ("ttft", "mean_ms"), "{:.0f}"),
    ("TTFT p50 ms", ("ttft", "p50_ms"), "{:.0f}"),
    ("TTFT p99 ms", ("ttft", "p99_ms"), "{:.0f}"),
    ("TBT p50 ms", ("tbt", "p50_ms"), "{:.0f}"),
    ("TBT p99 ms", ("tbt", "p99_ms"), "{:.0f}"),
    ("TPOT p50 ms", ("tpot", "p50_ms"), "{:.1f}"),
    ("TPOT p99 ms", ("tpot", "p99_ms"), "{:.1f}"),
    ("ITL p50 ms", ("itl", "p50_ms"), "{:.1f}"),
    ("ITL p99 ms", ("itl", "p99_ms"), "{:.1f}"),
    ("E2E p50 ms", ("e2e", "p50_ms"), "{:.0f}"),
    ("E2E p99 ms", ("e2e", "p99_ms"), "{:.0f}"),
    ("max send lag ms", ("max_send_lag_ms",), "{:.0f}"),
)


def lookup(summary: dict[str, Any], path: Sequence[str]) -> Any:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def table(runs: Sequence[dict[str, Any]]) -> str:
    """Configurations side by side, one metric a row."""
    names = [r["name"] for r in runs]
    width = max(12, *(len(n) for n in names))
    lines = ["metric".ljust(20) + "".join(n.rjust(width + 2) for n in names)]
    for label, path, fmt in ROWS:
        cells = []
        for r in runs:
            v = lookup(r["summary"], path)
            cells.append(("-" if v is None else fmt.format(v)).rjust(width + 2))
        lines.append(label.ljust(20) + "".join(cells))
    lines.append("effective capacity (share meeting the TTFT SLO and TBT <= threshold):")
    for t in runs[0]["summary"]["effective_capacity_by_tbt_ms"]:
        cells = [
            f"{r['summary']['effective_capacity_by_tbt_ms'][t]:.1%}".rjust(width + 2) for r in runs
        ]
        lines.append(f"  TBT <= {t} ms".ljust(20) + "".join(cells))
    return "\n".join(lines)


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=1))


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def figures(runs: Sequence[dict[str, Any]]) -> list[go.Figure]:
    """The report's charts: latency CDFs, latency over the replay, effective capacity by
    TBT threshold, and the checked figures side by side."""
    return [_cdfs(runs), _over_time(runs), _capacity(runs), _side_by_side(runs)]


def _cdfs(runs: Sequence[dict[str, Any]]) -> go.Figure:
    cdfs = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms)", "TBT (ms)", "E2E (ms)"))
    for r in runs:
        done = [q for q in r["records"] if q["status"] == "completed"]
        for col, key in enumerate(("ttft_s", "tbt_s", "e2e_s"), start=1):
            xs, ys = _cdf([q[key] * 1e3 for q in done if q[key] is not None])
            cdfs.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines",
                    name=r["name"],
                    legendgroup=r["name"],
                    showlegend=col == 1,
                ),
                1,
                col,
            )
    cdfs.update_layout(title="Latency distributions (CDF)", height=380)
    return cdfs


def _over_time(runs: Sequence[dict[str, Any]]) -> go.Figure:
    over = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        subplot_titles=("TTFT by arrival (ms)", "TBT by arrival (ms)"),
    )
    for r in runs:
        done = [q for q in r["records"] if q["status"] == "completed"]
        x = [q["arrival_s"] for q in done]
        over.add_trace(
            go.Scatter(
                x=x,
                y=[q["ttft_s"] * 1e3 for q in done],
                mode="markers",
                name=r["name"],
                legendgroup=r["name"],
            ),
            1,
            1,
        )
        over.add_trace(
            go.Scatter(
                x=x,
                y=[(q["tbt_s"] or 0) * 1e3 for q in done],
                mode="markers",
                name=r["name"],
                legendgroup=r["name"],
                showlegend=False,
            ),
            2,
            1,
        )
    over.update_layout(title="Over the replay (x: scheduled arrival, s)", height=520)
    return over


def _capacity(runs: Sequence[dict[str, Any]]) -> go.Figure:
    cap = go.Figure()
    for r in runs:
        c = r["summary"]["effective_capacity_by_tbt_ms"]
        cap.add_trace(
            go.Scatter(
                x=[float(t) for t in c], y=list(c.values()), mode="lines+markers", name=r["name"]
            )
        )
    cap.update_layout(
        title="Effective request capacity by TBT threshold (TTFT SLO met)",
        xaxis_title="TBT threshold (ms)",
        yaxis_title="share of requests",
        yaxis_tickformat=".0%",
        height=380,
    )
    return cap


def _side_by_side(runs: Sequence[dict[str, Any]]) -> go.Figure:
    bars = make_subplots(
        rows=1, cols=3, subplot_titles=("mean TTFT (ms)", "TBT p99 (ms)", "cache hit ratio")
    )
    names = [r["name"] for r in runs]
    for col, path in enumerate((("ttft", "mean_ms"), ("tbt", "p99_ms"), ("cache_hit_ratio",)), 1):
        bars.add_trace(
            go.Bar(x=names, y=[lookup(r["summary"], path) for r in runs], showlegend=False), 1, col
        )
    bars.update_layout(title="Side by side", height=360)
    return bars


def write_html(path: Path, report: dict[str, Any]) -> None:
    runs = report["runs"]
    parts = [
        f"<h1>Halfmoon trace replay</h1><p>{_esc(report['description'])}</p>",
        f"<pre>{_esc(table(runs))}</pre>",
    ]
    for comparison in report.get("comparisons", []):
        parts.append(f"<p><b>{_esc(comparison['text'])}</b></p>")
    for i, fig in enumerate(figures(runs)):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Halfmoon replay"
        "</title></head><body style='font-family:sans-serif'>" + "".join(parts) + "</body></html>"
    )


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
