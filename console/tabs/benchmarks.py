"""Benchmarks: the numbers and tables of a bench or replay report on disk."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from console import charts, reports
from console.view import View, chart


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
        chart(charts.report_bars(rows, labels[0], metric), f"report_{name}")


def benchmarks_page(view: View) -> None:
    path = st.text_input("Replay report (JSON or JSON Lines path)", key="report_path").strip()
    if not path:
        st.info("Enter the path of a benchmark or replay report to show its numbers.")
        return
    try:
        report = reports.load_report(path)
    except (OSError, ValueError) as exc:
        st.error(f"Cannot read report {path}: {exc}")
        return
    metrics, tables = reports.report_sections(report)
    if not metrics and not tables:
        st.info("The report has no numbers or tables this page can show.")
    for start in range(0, len(metrics), 4):
        cols = st.columns(4)
        for col, (key, value) in zip(cols, list(metrics.items())[start : start + 4]):
            col.metric(key, f"{value:,.4g}")
    for name, rows in tables.items():
        _report_table(name, rows)
