"""`halfmoon bench replay` end to end: it starts a colocated local cluster (the comparison
mode's path), replays a slice of the real trace through the gateway, and writes a report
whose numbers agree with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ADMIT_ALL

RUN_TIMEOUT_S = 600  # a bench run: starting a cluster, the slice, the report (a hang, if hit)
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


def bench(cmd: list[str]) -> subprocess.CompletedProcess:
    """Runs `halfmoon bench replay`. The replay sends no SLOs, so the clusters it starts
    refuse by their conductor's defaults: they admit all they have room for here, since
    these tests are about the bench's report, not admission."""
    env = {**os.environ, **ADMIT_ALL}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)


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
    proc = bench(cmd)
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


def test_replay_with_the_simulator_on_a_disaggregated_cluster(tmp_path: Path, model_dir: Path):
    """--sim: after the live run, the simulator replays the same requests with what the
    cluster measured: its calibrated models (the CPU-time fit, the handoff's spread) and
    what the rest of the machine took of the cores the engines share."""
    out = tmp_path / "report"
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "replay", "--model", str(model_dir),
        "--config", "pd=--prefill 1 --decode 1 --threads 1", "--sim",
        "--max-requests", "12", "--time-scale", "0.02", "--max-input-tokens", "256",
        "--max-output-tokens", "8", "--out", str(out),
    ]  # fmt: skip
    proc = bench(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "simulator against the live run (sim: the mean of 16 draws)" in proc.stdout

    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert run["summary"]["completed"] == 12
    # The cores' busy time over the run: the engines' steps (their heartbeats' work_cpu_s)
    # and the rest, which the simulator takes out of the engines' share.
    m = run["machine"]
    # (the kernel counts CPU time in ticks of 10 ms per CPU: a hair of slack)
    assert 0 < m["work_cores"] <= m["busy_cores"] + 0.05 and m["busy_cores"] <= m["cores"] + 0.05
    assert m["background_cores"] == max(0.0, m["busy_cores"] - m["work_cores"])
    per_request = m["background_cores"] * m["span_s"] / 12
    assert abs(m["background_s_per_request"] - per_request) < 1e-9
    # halfmoon up nices the engines by 10 (below the rest, started at this process's
    # niceness): the rest weighs 1.25^10 as much in the kernel's fair scheduler
    if os.nice(0) + 10 <= 19:
        assert abs(m["background_weight"] - 1.25**10) < 0.01
    sim = run["sim"]
    assert sim["draws"] == 16 and sim["background_s_per_request"] == per_request
    assert sim["work_model"].startswith("the live conductor's, fit on CPU time")
    # 11 handoffs at least (a one-token answer has none): a spread of 21 points, rising
    spread = sim["work_params"]["handoff_spread"]
    assert len(spread) == 21 and spread == sorted(spread) and spread[0] <= 1.0 <= spread[-1]
    rows = {r["figure"]: r for r in sim["side_by_side"]}
    assert {"mean TTFT ms", "TBT p99 ms", "hit ratio"} <= set(rows)
    assert all("within" in rows[f] for f in ("mean TTFT ms", "TBT p99 ms", "hit ratio"))
    assert sim["summary"]["completed"] == 12 and len(rows["TBT p99 ms"]["sim_range"]) == 2
    # and again without each measured input, to show what it moves
    assert "what each measured input moves" in proc.stdout
    assert "the handoff's spread (its line only)" in [r["without"] for r in sim["without"]]
