"""A fresh local cluster per configuration, started the way users start it (`halfmoon up`),
so a comparison measures exactly what people run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, BinaryIO

from services.conductor.costmodel import default_path as default_cost_model

log = logging.getLogger(__name__)
_ENV_TOKEN = re.compile(r"^HALFMOON_[A-Z0-9_]+=")


@dataclass(frozen=True)
class ClusterConfig:
    """A name and the `halfmoon up` flags that make it; HALFMOON_X=Y tokens among them are
    environment for every service (e.g. HALFMOON_PULL_PREFIXES=false for the conductor)."""

    name: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "ClusterConfig":
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip() or name.strip().startswith("-"):
            raise ValueError(f"config {spec!r}: expected NAME=FLAGS, e.g. "
                             "'colocated=--colocated 2'")
        flags, env = [], {}
        for token in shlex.split(rest):
            if _ENV_TOKEN.match(token):
                key, _, value = token.partition("=")
                env[key] = value
            else:
                flags.append(token)
        return cls(name.strip(), tuple(flags), env)

    def describe(self) -> str:
        return " ".join([*self.flags, *(f"{k}={v}" for k, v in self.env.items())])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def local_cluster(config: ClusterConfig, model_dir: Path, log_dir: Path,
                        ready_timeout_s: float = 300.0) -> AsyncIterator[str]:
    """Start `halfmoon up` with the config's flags in a scratch home (its own SQLite and
    NATS store); yield the gateway URL; stop it as Ctrl-C would."""
    port = free_port()
    home = Path(tempfile.mkdtemp(prefix=f"halfmoon-replay-{config.name}-"))
    env = dict(os.environ, HALFMOON_HOME=str(home), PYTHONUNBUFFERED="1", **config.env)
    if "HALFMOON_COST_MODEL" not in env and default_cost_model().exists():
        env["HALFMOON_COST_MODEL"] = str(default_cost_model())  # the one fitted here
    # No metrics ports unless asked for: a benchmark cluster must not collide with a running one.
    metrics = [] if any(f.startswith("--metrics") for f in config.flags) else [
        "--metrics-base-port", "0"]
    cmd = [sys.executable, "-m", "services.cli", "up", "--no-console", "--port", str(port),
           "--model", str(model_dir), *metrics, *config.flags]
    log_path = log_dir / f"{config.name}.log"
    with open(log_path, "wb") as out:
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        ready = asyncio.Event()
        pump = asyncio.create_task(_pump(proc, out, ready))
        try:
            await asyncio.wait_for(_ready(proc, pump, ready), ready_timeout_s)
            yield f"http://127.0.0.1:{port}"
        finally:
            await _stop(proc)
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            shutil.rmtree(home, ignore_errors=True)


async def _pump(proc: asyncio.subprocess.Process, out: BinaryIO, ready: asyncio.Event) -> None:
    """Copy the cluster's log to a file, noting the banner that says it is ready."""
    assert proc.stdout is not None
    async for line in proc.stdout:
        out.write(line)
        out.flush()
        if b"Halfmoon is up." in line:
            ready.set()


async def _ready(proc: asyncio.subprocess.Process, pump: asyncio.Task, ready: asyncio.Event) -> None:
    while not ready.is_set():
        if proc.returncode is not None or pump.done():
            raise RuntimeError(f"halfmoon up exited ({proc.returncode}) before it was ready")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ready.wait(), 0.2)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except asyncio.TimeoutError:
            log.warning("halfmoon up did not stop in 60s; killing it")
            proc.kill()
            await proc.wait()
