"""`halfmoon bench replay` end to end: it starts a colocated local cluster (the comparison
mode's path), replays a slice of the real trace through the gateway, and writes a report
whose numbers agree with each other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_replay_a_trace_slice_on_a_colocated_cluster(tmp_path: Path, model_dir: Path):
    out = tmp_path / "report"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "bench",
        "replay",
        "--model",
        str(model_dir),
        "--config",
        "colo=--colocated 2 --threads 1",
        "--max-requests",
        "8",
        "--time-scale",
        "0.02",
        "--max-input-tokens",
        "256",
        "--max-output-tokens",
        "8",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TBT p99 ms" in proc.stdout and "effective capacity" in proc.stdout

    report = json.loads((out / "report.json").read_text())
    run = report["runs"][0]
    s = run["summary"]
    assert run["name"] == "colo" and "--colocated 2" in run["config"]
    assert (s["requests"], s["completed"], s["failed"]) == (8, 8, 0)
    recs = run["records"]
    assert all(r["completion_tokens"] == r["output_tokens"] for r in recs)  # ignore_eos held
    assert all(r["ttft_s"] <= r["e2e_s"] and r["tbt_s"] >= 0 for r in recs)
    assert s["ttft"]["p50_ms"] <= s["ttft"]["p99_ms"] and s["throughput_rps"] > 0
    assert 0 <= s["cache_hit_ratio"] <= 1 and s["ideal_hit_ratio"] >= 0
    html = (out / "report.html").read_text()
    assert "plotly" in html.lower() and "Effective request capacity" in html
    assert (out / "colo.log").exists()
