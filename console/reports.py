"""Benchmark and replay reports for the Benchmarks page: whatever JSON a bench wrote,
reduced to numbers and tables of rows. Plain Python, testable without Streamlit."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load_report(path: str) -> Any:
    """A JSON document, or JSON Lines (one object per line, as `kv replay --json` prints)."""
    text = Path(path).expanduser().read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def report_sections(report: Any) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
    """Numeric top-level metrics (one level of nesting flattened) and tables of rows."""
    if isinstance(report, list):
        report = {"runs": report}
    if not isinstance(report, dict):
        return {}, {}
    metrics: dict[str, float] = {}
    tables: dict[str, list[dict[str, Any]]] = {}
    for key, value in report.items():
        if _is_number(value):
            metrics[str(key)] = value
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables[str(key)] = [_flat(v) for v in value]
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            tables[str(key)] = [{"name": str(k), **_flat(v)} for k, v in value.items()]
        elif isinstance(value, dict):
            metrics.update({f"{key}.{k}": v for k, v in value.items() if _is_number(v)})
    return metrics, tables


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """Scalars kept, one level of nested dicts flattened with dotted names, the rest dropped."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(
                {
                    f"{k}.{kk}": vv
                    for kk, vv in v.items()
                    if isinstance(vv, (str, int, float, bool)) or vv is None
                }
            )
        elif isinstance(v, (str, int, float, bool)) or v is None:
            out[str(k)] = v
    return out
