"""The whole local stack, started the way a user starts it: `halfmoon up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import backends, drop_database, free_port, make_database

# The conductor refuses what it predicts would miss its SLOs, and its predictions follow
# this machine's speed: the default SLOs (TTFT 30 s, TBT 300 ms) refuse, on a slow CPU,
# load that a fast one serves. So a stack under test admits all it has room for, and a
# test's outcome never hangs on the CPU it runs on; a test about admission puts the SLOs
# it means on its requests (a request's own SLOs win over these defaults). Tools started
# as commands (`halfmoon chaos`, `halfmoon bench replay`) get the same through their env.
ADMIT_ALL = {"HALFMOON_TTFT_SLO_MS": "3600000", "HALFMOON_TBT_SLO_MS": "60000"}


@dataclass
class Stack:
    url: str
    database_url: str
    proc: subprocess.Popen
    log_path: Path
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.lines)


def start_stack(
    tmp: Path,
    model_dir: Path,
    database_url: str,
    extra: list[str] | None = None,
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
) -> Stack:
    port = free_port()
    env = {
        **os.environ,
        "HALFMOON_HOME": str(tmp / "home"),
        "PYTHONUNBUFFERED": "1",
        **ADMIT_ALL,
        **(env or {}),
    }
    extra = list(extra or [])
    if "--metrics-base-port" not in extra:  # no fixed ports: stacks may run side by side
        extra += ["--metrics-base-port", "0"]
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--no-console",
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--database-url",
        database_url,
        *extra,
    ]
    log_path = tmp / "stack.log"
    lines: list[str] = []
    proc = until_banner(cmd, env, log_path, lines, timeout_s)
    return Stack(f"http://127.0.0.1:{port}", database_url, proc, log_path, lines)


def until_banner(
    cmd: list[str], env: dict[str, str], log_path: Path, lines: list[str], timeout_s: float
) -> subprocess.Popen:
    """Start a command that prints a banner once ready (`halfmoon up`, `halfmoon cluster
    up`); its output goes on into `lines` and `log_path`. Stopped, and a RuntimeError with
    its last output, if it exits or is not ready in `timeout_s`."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ready = threading.Event()

    def pump() -> None:
        with open(log_path, "w") as out:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line)
                out.write(line)
                out.flush()
                if "Ctrl-C stops everything." in line:  # the banner's last line
                    ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate(proc)
            raise RuntimeError(f"{cmd[3]} did not come up:\n{''.join(lines)[-4000:]}")
    return proc


def terminate(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """SIGTERM, as Ctrl-C would; SIGKILL if it has not exited in `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_stack(stack: Stack) -> int:
    """SIGTERM `halfmoon up` as Ctrl-C would; it must exit 0 and leave no process behind."""
    children = children_of(stack.proc.pid)
    terminate(stack.proc)
    orphans = [pid for pid in children if alive(pid)]
    assert not orphans, f"processes left behind: {orphans}"
    return stack.proc.returncode


@pytest.fixture(scope="session", params=backends())
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_dir: Path
):
    """One running cluster (fp32, so greedy output can be compared exactly) per SQL backend."""
    tmp = tmp_path_factory.mktemp(f"stack-{request.param}")
    database_url, pg_name = make_database(request.param, tmp)
    s = start_stack(tmp, model_dir, database_url, ["--dtype", "float32"])
    # nats-server, conductor, kvmanager, prefill, decode, gateway
    assert len(children_of(s.proc.pid)) == 6
    yield s
    rc = stop_stack(s)
    drop_database(pg_name)
    assert rc == 0, f"halfmoon up exited {rc}:\n{s.log()[-3000:]}"
