"""A second `halfmoon up` beside a running one stops before it starts anything, with one
line that names the taken port, the setting that moves it and the process holding it."""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import urlsplit

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_a_second_up_on_a_taken_port_says_which_port_and_who_holds_it(stack, model_dir, tmp_path):
    port = urlsplit(stack.url).port
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--port",
            str(port),
            "--no-console",
            "--metrics-base-port",
            "0",
            "--model",
            str(model_dir),
        ],
        env={"HALFMOON_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,  # a failure bound: it exits before loading anything
    )
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"port {port} (the gateway) on 127.0.0.1 is taken" in lines[0]
    assert "services.gateway" in lines[0]  # the running stack's gateway holds it
    assert "--port (HALFMOON_PORT)" in lines[0]
    # Nothing was started: no NATS, database or model folder under its home.
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").iterdir())
