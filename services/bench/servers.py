"""Servers the serving benchmark starts itself: Halfmoon's local stack, `transformers serve`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shared.lifecycle import child_preexec



def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    name = "server"
    has_ready_line = False  # else /health answering means ready

    def __init__(self, model_dir: Path, dtype: str, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.model_dir, self.dtype, self.extra, self.env = model_dir, dtype, extra or [], env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []
        self._ready = threading.Event()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"hm-bench-{self.name}-"))

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready_line(self, line: str) -> bool:
        return False

    def start(self, timeout_s: float = 300) -> None:
        env = dict(os.environ, HALFMOON_HOME=str(self.tmp / "home"), PYTHONUNBUFFERED="1",
                   HF_HUB_OFFLINE="1", **self.env)
        # Its own process group (stopped as a whole), and gone if the bench dies.
        self.proc = subprocess.Popen(self.command(), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=child_preexec)
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{''.join(self.log[-40:])}")
            if self._ready.is_set() or (not self.has_ready_line and _healthy(self.url)):
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} did not start in {timeout_s}s")

    def _pump(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            self.log.append(line)
            if self.ready_line(line):
                self._ready.set()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


class HalfmoonServer(Server):
    name = "halfmoon"
    has_ready_line = True  # the gateway answers /health before the workers are ready

    def command(self) -> list[str]:
        return [sys.executable, "-m", "services.cli", "up", "--no-console", "--port",
                str(self.port), "--model", str(self.model_dir), "--dtype", self.dtype, *self.extra]

    def ready_line(self, line: str) -> bool:
        return "Halfmoon is up." in line


class TransformersServer(Server):
    def __init__(self, model_dir: Path, dtype: str, continuous_batching: bool) -> None:
        self.cb = continuous_batching
        self.name = "transformers-serve" + ("-cb" if continuous_batching else "")
        super().__init__(model_dir, dtype)

    def command(self) -> list[str]:
        exe = Path(sys.executable).with_name("transformers")
        cb = ["--continuous-batching"] if self.cb else []
        return [str(exe), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port",
                str(self.port), "--dtype", self.dtype, "--device", "cpu", *cb]


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False
