"""`halfmoon up`: the whole local cluster on embedded defaults, one command.

Starts an embedded nats-server (unless HALFMOON_NATS_URL is given), applies migrations to
SQLite (unless HALFMOON_DATABASE_URL is given), then each service as its own process. It
waits until every service reports ready, prints the URLs, and on Ctrl-C / SIGTERM stops
them in order: intake first (gateway), then scheduling, workers, the rest, NATS last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import aiohttp
import nats
from pydantic import BaseModel, Field

from shared import subjects
from shared.db import session as db
from shared.lifecycle import child_preexec, install_stop_signals, setup_logging
from shared.messages import InstanceInfo
from shared.model_store import ensure_model
from shared.natsd import EmbeddedNats
from shared.settings import DEFAULT_MODEL_NAME, halfmoon_home, parse_settings

log = logging.getLogger("halfmoon.up")
STOP_ORDER = ("gateway", "conductor", "prefill", "decode", "kvmanager", "console")


class UpSettings(BaseModel):
    host: str = Field("127.0.0.1", description="address the gateway and console bind")
    port: int = Field(8000, ge=1, le=65535, description="gateway HTTP port")
    console: bool = Field(True, description="start the Streamlit console")
    console_port: int = Field(8501, ge=1, le=65535, description="console HTTP port")
    prefill: int = Field(1, ge=1, description="prefill instances")
    decode: int = Field(1, ge=1, description="decode instances")
    model: str = Field(DEFAULT_MODEL_NAME, description="model folder or name in HALFMOON_HOME/models")
    dtype: str = Field("bfloat16", description="float32 | bfloat16")
    threads: int = Field(0, ge=0, description="torch threads per engine instance (0: cores / instances)")
    engine_nice: int = Field(10, ge=0, le=19, description="niceness of engine processes, so the "
                             "control plane stays responsive when the cores are busy")
    nats_url: str = Field("", description="external NATS (empty: embedded nats-server)")
    database_url: str = Field("", description="SQLAlchemy URL (empty: SQLite in HALFMOON_HOME)")
    ready_timeout_s: float = Field(300.0, gt=0, description="give up if not ready by then")
    log_level: str = Field("INFO", description="logging level for every service")


@dataclass
class Child:
    name: str
    role: str
    proc: asyncio.subprocess.Process


class Cluster:
    def __init__(self, settings: UpSettings) -> None:
        self.s = settings
        self.home = halfmoon_home()
        self.children: list[Child] = []
        self.nats: EmbeddedNats | None = None
        self.nats_url = settings.nats_url
        self.database_url = settings.database_url

    def expected(self) -> Counter:
        return Counter({"gateway": 1, "conductor": 1, "kvmanager": 1,
                        "prefill": self.s.prefill, "decode": self.s.decode})

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(HALFMOON_HOME=str(self.home), HALFMOON_NATS_URL=self.nats_url,
                   HALFMOON_DATABASE_URL=self.database_url, HALFMOON_LOG_LEVEL=self.s.log_level,
                   PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        return env

    async def _spawn(self, name: str, role: str, args: list[str],
                     env: dict[str, str] | None = None) -> None:
        proc = await asyncio.create_subprocess_exec(sys.executable, *args,
                                                    env={**self._env(), **(env or {})},
                                                    preexec_fn=child_preexec)
        self.children.append(Child(name, role, proc))

    async def start(self, model_dir: Path) -> None:
        engines = self.s.prefill + self.s.decode
        threads = self.s.threads or max(1, (os.cpu_count() or 1) // engines)
        common = ["--model", str(model_dir)]
        engine = [*common, "--dtype", self.s.dtype, "--threads", str(threads), "--nice",
                  str(self.s.engine_nice)]
        await self._spawn("conductor", "conductor", ["-m", "services.conductor"])
        await self._spawn("kvmanager", "kvmanager", ["-m", "services.kvmanager"])
        for i in range(self.s.prefill):
            await self._spawn(f"prefill-{i}", "prefill", [
                "-m", "services.prefill", "--instance-id", f"prefill-{i}", *engine])
        for i in range(self.s.decode):
            await self._spawn(f"decode-{i}", "decode", [
                "-m", "services.decode", "--instance-id", f"decode-{i}", *engine])
        await self._spawn("gateway", "gateway", ["-m", "services.gateway", "--host", self.s.host,
                                                 "--port", str(self.s.port), *common])
        if self.s.console:
            app = Path(__file__).resolve().parents[1] / "console" / "app.py"
            await self._spawn("console", "console", [
                "-m", "streamlit", "run", str(app), "--server.headless", "true",
                "--server.address", self.s.host, "--server.port", str(self.s.console_port),
                "--browser.gatherUsageStats", "false"],
                env={"HALFMOON_GATEWAY_URL": f"http://{self.s.host}:{self.s.port}"})

    async def wait_ready(self, stop: asyncio.Event) -> bool:
        seen: dict[str, str] = {}

        async def on_beat(msg) -> None:  # type: ignore[no-untyped-def]
            info = InstanceInfo.model_validate_json(msg.data)
            seen[info.instance_id] = info.role.value

        nc = await nats.connect(self.nats_url)
        try:
            await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
            deadline = time.monotonic() + self.s.ready_timeout_s
            while time.monotonic() < deadline and not stop.is_set():
                if self._dead_child():
                    return False
                have = Counter(seen.values())
                if all(have[r] >= n for r, n in self.expected().items()) and await self._http_ready():
                    return True
                await asyncio.sleep(0.25)
            return False
        finally:
            await nc.close()

    async def _http_ready(self) -> bool:
        urls = [f"http://{self.s.host}:{self.s.port}/health"]
        if self.s.console:
            urls.append(f"http://{self.s.host}:{self.s.console_port}/_stcore/health")
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
                for url in urls:
                    async with http.get(url) as resp:
                        if resp.status != 200:
                            return False
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return True

    def _dead_child(self) -> Child | None:
        return next((c for c in self.children if c.proc.returncode is not None), None)

    async def watch(self, stop: asyncio.Event) -> int:
        """Run until a signal (rc 0) or a child's unexpected exit (rc 1)."""
        while not stop.is_set():
            dead = self._dead_child()
            if dead is not None:
                log.error("%s exited with code %s; stopping the cluster", dead.name,
                          dead.proc.returncode)
                return 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return 0

    async def stop(self) -> None:
        for role in STOP_ORDER:
            group = [c for c in self.children if c.role == role and c.proc.returncode is None]
            for child in group:
                child.proc.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    await asyncio.wait_for(child.proc.wait(), 20)
                except asyncio.TimeoutError:
                    log.warning("%s did not stop in 20s; killing it", child.name)
                    child.proc.kill()
                    await child.proc.wait()
        if self.nats is not None:
            self.nats.stop()


def _banner(s: UpSettings, cluster: Cluster) -> str:
    lines = ["", "Halfmoon is up.",
             f"  API      http://{s.host}:{s.port}/v1   (OpenAI-compatible; model: see /v1/models)"]
    if s.console:
        lines.append(f"  console  http://{s.host}:{s.console_port}")
    lines += [f"  NATS     {cluster.nats_url}",
              f"  SQL      {db.resolve_url(cluster.database_url).split('@')[-1]}",
              f"  workers  {s.prefill} prefill, {s.decode} decode", "Ctrl-C stops everything.", ""]
    return "\n".join(lines)


async def run(s: UpSettings) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    cluster = Cluster(s)
    model_dir = await asyncio.to_thread(ensure_model, s.model)
    if not cluster.nats_url:
        cluster.nats = EmbeddedNats(cluster.home / "nats")
        cluster.nats_url = await asyncio.to_thread(cluster.nats.start)
    await db.upgrade_async(cluster.database_url)
    rc = 1
    try:
        await cluster.start(model_dir)
        if not await cluster.wait_ready(stop):
            if not stop.is_set():
                log.error("the cluster did not become ready; stopping")
            return 0 if stop.is_set() else 1
        print(_banner(s, cluster), flush=True)
        rc = await cluster.watch(stop)
    finally:
        log.info("stopping the cluster")
        await cluster.stop()
        log.info("stopped")
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_settings(UpSettings, argv, "halfmoon up",
                       "Start the whole local cluster on embedded defaults.")
    setup_logging(s.log_level, "up")
    try:
        return asyncio.run(run(s))
    except KeyboardInterrupt:
        return 130
