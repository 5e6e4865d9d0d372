"""The console in a real browser, on a real stack.

`halfmoon up` with the console, four chat requests (two share a long prefix, so the second
one is served partly from the prefix cache), then headless Chromium (Debian's, driven by npm
playwright-core from tests/e2e/console_browser.mjs) opens the console, waits for its charts,
and reports what it shows: the Pools tab must list the live prefill-0 and decode-0 and chart
their load over time, the KV hit rate must be above zero, the KV cache tab must count the
prefill → decode KV transfers the conductor sampled from heartbeats, and the Requests tab must
draw the newest request's measured phases and the conductor's placement. Screenshots go to
$HALFMOON_SCREENSHOT_DIR (default reports/console/ in the repository).

Needs /usr/bin/chromium, node and playwright-core in .cache/node: `bash scripts/install-browser.sh`
installs them. Without them the test skips, or fails when CI is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port, make_database
from tests.e2e.conftest import start_stack, stop_stack

# Failure bounds only: each wait ends the moment its condition holds. Chromium, Streamlit and
# the stack share the machine, and on a slow one (a 0.6-CPU quota) a first chart took more
# than a minute to draw: each of the browser's waits gets WAIT_MS, the whole script RUN_S.
WAIT_MS = 240_000
RUN_S = 900
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(RUN_S + 600)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("console_browser.mjs")
CHROMIUM = os.environ.get("HALFMOON_CHROMIUM", "/usr/bin/chromium")
NODE_PREFIX = Path(os.environ.get("HALFMOON_NODE_PREFIX") or REPO / ".cache" / "node")
MODEL = "SmolLM2-135M-Instruct"
# ~300 tokens shared by two requests: well over the 16-token KV block.
PREFIX = "You are the operations assistant of a small observatory. " + " ".join(
    f"Rule {i}: log every observation of night {i} with its time, sky quality and the "
    "instrument used, and never discard raw frames."
    for i in range(1, 13)
)


def browser_tools() -> str:
    """The node binary, once chromium, node and playwright-core are all there."""
    node = shutil.which("node")
    missing = []
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"chromium at {CHROMIUM}")
    if node is None:
        missing.append("node")
    if not (NODE_PREFIX / "node_modules" / "playwright-core" / "package.json").is_file():
        missing.append(f"npm playwright-core in {NODE_PREFIX}")
    if missing:
        message = (
            f"the console browser test needs {', '.join(missing)}; "
            "run `bash scripts/install-browser.sh`"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return node  # type: ignore[return-value]


def chat(url: str, messages: list[dict], max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def test_console_in_browser(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = browser_tools()  # skip (or fail, under CI) before provisioning the model
    model_dir: Path = request.getfixturevalue("model_dir")
    shots = Path(os.environ.get("HALFMOON_SCREENSHOT_DIR") or REPO / "reports" / "console")
    gateway_port, console_port = free_port(), free_port()
    gateway = f"http://127.0.0.1:{gateway_port}"
    # `halfmoon up` hands its environment to the console, which reads the gateway's live state
    # from HALFMOON_GATEWAY_URL (default :8000, not this stack's port).
    monkeypatch.setenv("HALFMOON_GATEWAY_URL", gateway)
    database_url, _ = make_database("sqlite", tmp_path)
    # start_stack passes --no-console and a port of its own; flags given later win.
    stack = start_stack(
        tmp_path,
        model_dir,
        database_url,
        ["--console", "--console-port", str(console_port), "--port", str(gateway_port)],
    )
    stack.url = gateway
    try:
        usages = []
        for messages in (
            [
                {"role": "system", "content": PREFIX},
                {"role": "user", "content": "What should I log tonight?"},
            ],
            [
                {"role": "system", "content": PREFIX},
                {"role": "user", "content": "Can I delete raw frames?"},
            ],
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Name a planet."}],
        ):
            usages.append(chat(gateway, messages)["usage"])
        cached = [u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages]
        print(f"\nprompt tokens {[u['prompt_tokens'] for u in usages]}, cached {cached}")
        assert cached[1] >= 16 * 10, usages  # the shared prefix came from the cache

        started = time.monotonic()
        run = subprocess.run(
            [
                node,
                str(SCRIPT),
                "--url",
                f"http://127.0.0.1:{console_port}",
                "--out",
                str(shots),
                "--timeout-ms",
                str(WAIT_MS),
            ],
            capture_output=True,
            text=True,
            timeout=RUN_S,
            cwd=REPO,
        )
        lines = run.stdout.strip().splitlines()
        assert lines, f"no output from the browser script (rc {run.returncode}):\n{run.stderr}"
        summary = json.loads(lines[-1])
        print(f"browser: {time.monotonic() - started:.1f} s, rc {run.returncode}")
        print("summary:", json.dumps(summary, indent=1))
        print(f"screenshots in {shots}")
        assert run.returncode == 0 and not summary["errors"], (summary["errors"], run.stderr)

        assert {"prefill-0", "decode-0"} <= set(summary["instances"]), summary
        assert any(c.startswith("Live from gateway") for c in summary["pool_captions"]), summary
        assert not any("Dead instances" in a for a in summary["pool_alerts"]), summary
        assert "Prefill pool (1)" in summary["pool_headers"], summary
        assert "Decode pool (1)" in summary["pool_headers"], summary
        for key in ("overview_hit_rate", "kv_hit_rate"):
            rate = summary[key]
            assert rate is not None and rate["text"].endswith("%"), (key, summary)
            assert rate["percent"] > 0, (key, summary)
        # History through the real write path: heartbeats → conductor → load_samples.
        assert {
            "Queue depth over time",
            "Running batch over time",
            "KV blocks over time, DRAM tier",
        } <= set(summary["pool_chart_titles"]), summary
        assert {"Hottest prefixes", "Evictions and transfers over time"} <= set(
            summary["kv_headers"]
        ), summary
        assert summary["kv_transfers_in"] and summary["kv_transfers_in"] >= 1, summary
        assert any(t.startswith("KV transfers per") for t in summary["kv_chart_titles"]), summary
        # The newest request: phases the gateway measured, and why it went where it went.
        assert any(t.startswith("Timeline of chatcmpl-") for t in summary["request_chart_titles"])
        for phase in ("placement (conductor)", "prefill queue + prefill"):
            assert phase in summary["request_chart_text"], summary
        if usages[-1]["completion_tokens"] >= 2:  # a token from decode: the handoff is measured
            assert "KV transfer + decode admission" in summary["request_chart_text"], summary
        assert summary["request_placement"] and "prefill-0" in summary["request_placement"][0]
        for name in ("overview", "pools", "kv", "requests"):
            assert Path(summary["screenshots"][name]).stat().st_size > 10_000, summary
    finally:
        rc = stop_stack(stack)
    assert rc == 0, f"halfmoon up exited {rc}:\n{stack.log()[-3000:]}"
