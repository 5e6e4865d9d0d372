"""`halfmoon chaos`, short: a minute of streaming load while a prefill worker, a decode
worker, the conductor, the kvmanager and the nats-server are each SIGKILLed once (and
restarted by the cluster's supervisor). Nothing may hang, no record may be lost, and the
cluster must serve again afterwards. (Longer runs: see the README's Chaos paragraph.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.tools.chaos.args import SWITCH_TARGETS, TARGETS
from tests.e2e.conftest import ADMIT_ALL

RUN_TIMEOUT_S = 600  # a minute of load, then recovery and the audit: a hang, if reached
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


def test_a_short_chaos_run_hangs_nothing_and_loses_nothing(tmp_path, model_dir):
    report_path = tmp_path / "chaos.json"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "chaos",
        "--duration-s",
        "60",
        "--rate",
        "1",
        "--kill-every-s",
        "10",
        "--seed",
        "1",
        "--model",
        str(model_dir),
        "--report",
        str(report_path),
    ]
    # About faults, not admission: the cluster it starts admits all it has room for (on an
    # AVX2 CPU, the default TBT SLO refused half of this load before any fault).
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, **ADMIT_ALL},
    )
    (tmp_path / "chaos.log").write_text(proc.stdout)
    tail = proc.stdout[-4000:]
    assert report_path.exists(), tail
    report = json.loads(report_path.read_text())
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(("chaos:", "  "))))
    assert {k["target"] for k in report["kills"]} == set(TARGETS), report["kills"]
    assert report["hung"] == 0, report["hung_examples"]
    assert report["records_lost"] == 0, report["records"]
    assert report["inconsistent"] == 0
    assert report["recovery"]["recovered"], report["recovery"]
    assert report["completed"] >= report["sent"] // 2, report  # faults, not an outage
    assert report["records"]["rows"] >= report["sent"]
    assert proc.returncode == 0, tail


def test_kills_during_role_switches_hang_nothing_and_lose_nothing(tmp_path, model_dir):
    """Role switches begun under load, each followed at once by a SIGKILL of the switching
    instance or of the conductor running the switch (halfmoon chaos's switch targets): every
    switch ends as done or failed in SQL."""
    report_path = tmp_path / "chaos.json"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "chaos",
        "--duration-s",
        "40",
        "--rate",
        "1",
        "--kill-every-s",
        "10",
        "--seed",
        "1",
        "--targets",
        ",".join(SWITCH_TARGETS),
        "--model",
        str(model_dir),
        "--report",
        str(report_path),
    ]
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, **ADMIT_ALL},
    )
    (tmp_path / "chaos.log").write_text(proc.stdout)
    tail = proc.stdout[-4000:]
    assert report_path.exists(), tail
    report = json.loads(report_path.read_text())
    assert {k["target"] for k in report["kills"]} == set(SWITCH_TARGETS), report["kills"]
    assert report["hung"] == 0, report["hung_examples"]
    assert report["records_lost"] == 0, report["records"]
    # a switch whose conductor was killed is settled by the leader, not left "draining"
    assert report["records"]["switches_draining"] == [], report["records"]
    assert report["inconsistent"] == 0
    assert report["recovery"]["recovered"], report["recovery"]
    assert report["completed"] >= report["sent"] // 2, report
    assert proc.returncode == 0, tail
