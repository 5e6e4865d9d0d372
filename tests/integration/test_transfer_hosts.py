"""The KV data plane between two hosts (network namespaces): `halfmoon bench transfer
--across-hosts` moves verified bytes both ways it measures and removes its hosts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.tools.hosts.netns import namespaces, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no hosts here: {unavailable()}")


def test_transfer_across_hosts_runs_tcp_against_plain_and_cleans_up(tmp_path) -> None:
    before = set(namespaces())
    out = tmp_path / "transfer.json"
    cmd = [sys.executable, "-m", "services.cli", "bench", "transfer", "--across-hosts"]
    cmd += ["--mib", "8", "--rounds", "1", "--json-out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    # Every mode ran and its bytes matched the sender's checksum (the bench raises if not).
    assert set(doc["results"]) == {"plain", "plain_reused", "tcp", "tcp_reused"}
    assert set(doc["ratios"]) == {"tcp_over_plain", "tcp_reused_over_plain_reused"}
    assert all(r["target"] == 0.8 for r in doc["ratios"].values())
    assert "between two hosts" in doc["setup"]["link"]
    assert set(namespaces()) == before
