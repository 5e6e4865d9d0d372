"""`halfmoon up`: the whole local cluster on embedded defaults, one command.

Starts an embedded nats-server (unless HALFMOON_NATS_URL is given), applies migrations to
SQLite (unless HALFMOON_DATABASE_URL is given), then each service as its own process. It
waits until every service reports ready, prints the URLs, and on Ctrl-C / SIGTERM stops
them in order: intake first (gateway), then scheduling, workers, the rest, NATS last.

It supervises: a service (or the embedded nats-server) that dies is started again, with a
backoff that doubles while it keeps dying young, so a local cluster survives a crash
(`--no-restart`: a death stops the cluster instead).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import aiohttp
import nats
from pydantic import BaseModel, Field, field_validator

from shared import bus, subjects
from shared.db import session as db
from shared.engine import cpu
from shared.lifecycle import child_preexec, install_stop_signals, setup_logging
from shared.messages import InstanceInfo
from shared.model_store import ensure_model
from shared.natsd import EmbeddedNats
from shared.settings import (
    DEFAULT_MODEL_NAME,
    BaseSettings,
    halfmoon_home,
    parse_settings,
    settings_from,
)

log = logging.getLogger("halfmoon.up")
STOP_ORDER = ("gateway", "conductor", "prefill", "decode", "kvmanager", "console")


class UpSettings(BaseModel):
    host: str = Field("127.0.0.1", description="address the gateway and console bind")
    port: int = Field(8000, ge=1, le=65535, description="gateway HTTP port")
    console: bool = Field(True, description="start the Streamlit console")
    console_port: int = Field(8501, ge=1, le=65535, description="console HTTP port")
    prefill: int = Field(1, ge=1, description="prefill instances")
    decode: int = Field(1, ge=1, description="decode instances")
    conductors: int = Field(
        1,
        ge=1,
        description="conductors: one leads (places requests), the "
        "others are warm standbys that take over within ~4 s",
    )
    colocated: int = Field(
        0,
        ge=0,
        description="colocated instances that prefill and decode "
        "alike (the usual single-process layout, for comparison); when set, "
        "--prefill/--decode are ignored",
    )
    policy: str = Field("kvcentric", description="the conductor's placement policy")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from services.conductor.policy import make_policy

        make_policy(v)  # raises ValueError naming the choices
        return v

    model: str = Field(
        DEFAULT_MODEL_NAME, description="model folder or name in HALFMOON_HOME/models"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="auto | float32 | bfloat16 (auto: bfloat16 where the CPU computes it natively)",
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="engine weights: none, or int8 (per-channel weights, per-token activations)",
    )
    threads: int = Field(
        0, ge=0, description="torch threads per engine instance (0: cores / instances)"
    )
    engine_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="niceness of engine processes, so the "
        "control plane stays responsive when the cores are busy",
    )
    nats_url: str = Field("", description="external NATS (empty: embedded nats-server)")
    database_url: str = Field("", description="SQLAlchemy URL (empty: SQLite in HALFMOON_HOME)")
    ready_timeout_s: float = Field(300.0, gt=0, description="give up if not ready by then")
    log_level: str = Field("INFO", description="logging level for every service")
    restart: bool = Field(
        True, description="start a service that dies again (off: stop the cluster when one dies)"
    )
    restart_backoff_s: float = Field(
        1.0,
        gt=0,
        description="first restart delay; it doubles "
        "each time the same service dies young, up to the max",
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, description="longest restart delay")
    metrics_base_port: int = Field(
        9100,
        ge=0,
        le=65535,
        description="Prometheus /metrics: "
        "conductor, kvmanager and each engine get one port each from "
        "here up, in start order (listed in the banner); 0: off. "
        "The gateway serves /metrics on its API port",
    )


STABLE_S = 30.0  # a child that ran this long before dying starts its backoff afresh


@dataclass
class Child:
    name: str
    role: str
    proc: asyncio.subprocess.Process
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    streak: int = 0  # deaths in a row, each soon after its start
    restart_at: float | None = None  # dead, and due to start again then


def restart_delay(streak: int, base_s: float, max_s: float) -> float:
    """Backoff before the next start of a child that died `streak` times in a row young."""
    return min(max_s, base_s * 2 ** max(0, streak - 1))


class LocalCluster:
    def __init__(self, settings: UpSettings) -> None:
        self.s = settings
        self.home = halfmoon_home()
        self.children: list[Child] = []
        self.nats: EmbeddedNats | None = None
        self.nats_url = settings.nats_url
        self.database_url = settings.database_url
        self.metrics_ports: dict[str, int] = {}  # child name -> its /metrics port

    def expected(self) -> Counter:
        prefill, decode = self.engines()
        return Counter(
            {
                "gateway": 1,
                "conductor": self.s.conductors,
                "kvmanager": 1,
                "prefill": prefill,
                "decode": decode,
            }
        )

    def engines(self) -> tuple[int, int]:
        """(prefill, decode) engine processes; colocated ones register as prefill."""
        if self.s.colocated:
            return self.s.colocated, 0
        return self.s.prefill, self.s.decode

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HALFMOON_HOME=str(self.home),
            HALFMOON_NATS_URL=self.nats_url,
            HALFMOON_DATABASE_URL=self.database_url,
            HALFMOON_LOG_LEVEL=self.s.log_level,
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        return env

    async def _spawn(
        self, name: str, role: str, args: list[str], env: dict[str, str] | None = None
    ) -> None:
        proc = await self._exec(name, role, args, env or {})
        self.children.append(Child(name, role, proc, args, env or {}))

    async def _exec(
        self, name: str, role: str, args: list[str], env: dict[str, str]
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            env={**self._env(), **self._metrics_env(name, role), **env},
            preexec_fn=child_preexec,
        )

    def _metrics_env(self, name: str, role: str) -> dict[str, str]:
        """A distinct /metrics port per child, kept across restarts of the same child."""
        if role == "console":
            return {}
        port = 0
        if role != "gateway" and self.s.metrics_base_port:  # the gateway uses its API port
            port = self.metrics_ports.get(name) or (
                self.s.metrics_base_port + len(self.metrics_ports)
            )
            if port > 65535:
                log.warning(
                    "%s: no port left for /metrics above %d", name, self.s.metrics_base_port
                )
                port = 0
            else:
                self.metrics_ports[name] = port
        return {"HALFMOON_METRICS_HOST": self.s.host, "HALFMOON_METRICS_PORT": str(port)}

    async def start(self, model_dir: Path) -> None:
        n_prefill, n_decode = self.engines()
        engines = n_prefill + n_decode
        threads = self.s.threads or max(1, (os.cpu_count() or 1) // engines)
        common = ["--model", str(model_dir)]
        engine = [
            *common,
            "--dtype",
            self.s.dtype,
            "--quantization",
            self.s.quantization,
            "--threads",
            str(threads),
            "--nice",
            str(self.s.engine_nice),
        ]
        layout = "colocated" if self.s.colocated else "disaggregated"
        conductor = ["--policy", self.s.policy, "--layout", layout]
        for i in range(self.s.conductors):
            named = ["--instance-id", f"conductor-{i}"] if self.s.conductors > 1 else []
            await self._spawn(
                f"conductor-{i}" if named else "conductor",
                "conductor",
                ["-m", "services.conductor", *named, *conductor],
            )
        await self._spawn("kvmanager", "kvmanager", ["-m", "services.kvmanager"])
        name = "colocated" if self.s.colocated else "prefill"
        for i in range(n_prefill):
            await self._spawn(
                f"{name}-{i}",
                "prefill",
                ["-m", "services.prefill", "--instance-id", f"{name}-{i}", *engine],
            )
        for i in range(n_decode):
            await self._spawn(
                f"decode-{i}",
                "decode",
                ["-m", "services.decode", "--instance-id", f"decode-{i}", *engine],
            )
        await self._spawn(
            "gateway",
            "gateway",
            ["-m", "services.gateway", "--host", self.s.host, "--port", str(self.s.port), *common],
        )
        if self.s.console:
            app = Path(__file__).resolve().parents[1] / "console" / "app.py"
            await self._spawn(
                "console",
                "console",
                [
                    "-m",
                    "streamlit",
                    "run",
                    str(app),
                    "--server.headless",
                    "true",
                    "--server.address",
                    self.s.host,
                    "--server.port",
                    str(self.s.console_port),
                    "--browser.gatherUsageStats",
                    "false",
                ],
                # The console asks for the admin key when it listens beyond loopback.
                env={
                    "HALFMOON_GATEWAY_URL": f"http://{self.s.host}:{self.s.port}",
                    "HALFMOON_CONSOLE_HOST": self.s.host,
                },
            )

    async def wait_ready(self, stop: asyncio.Event) -> bool:
        seen: dict[str, str] = {}

        async def on_beat(msg) -> None:  # type: ignore[no-untyped-def]
            info = InstanceInfo.model_validate_json(msg.data)
            seen[info.instance_id] = info.role.value

        # The services read HALFMOON_NATS_USER, _CREDS, _TLS_* from the environment they
        # inherit; this process watches their heartbeats with the same credentials.
        security = bus.security_options(
            settings_from(BaseSettings, overrides={"nats_url": self.nats_url})
        )
        nc = await nats.connect(self.nats_url, **security)
        try:
            await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
            deadline = time.monotonic() + self.s.ready_timeout_s
            while time.monotonic() < deadline and not stop.is_set():
                if self._dead_child():
                    return False
                have = Counter(seen.values())
                if (
                    all(have[r] >= n for r, n in self.expected().items())
                    and await self._http_ready()
                ):
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
        except (TimeoutError, aiohttp.ClientError):
            return False
        return True

    def _dead_child(self) -> Child | None:
        return next((c for c in self.children if c.proc.returncode is not None), None)

    def _fatal_child(self) -> Child | None:
        """A dead child that ends the cluster. A dead conductor does not while another one
        lives: a standby takes over."""
        conductors = [c for c in self.children if c.role == "conductor"]
        standby = any(c.proc.returncode is None for c in conductors)
        return next(
            (
                c
                for c in self.children
                if c.proc.returncode is not None and not (c.role == "conductor" and standby)
            ),
            None,
        )

    async def watch(self, stop: asyncio.Event) -> int:
        """Run until a signal (rc 0); a child that dies is started again (with --no-restart,
        its unexpected exit ends the run: rc 1)."""
        while not stop.is_set():
            if self.s.restart:
                await self.supervise(time.monotonic())
            else:
                dead = self._fatal_child()
                if dead is not None:
                    log.error(
                        "%s exited with code %s; stopping the cluster",
                        dead.name,
                        dead.proc.returncode,
                    )
                    return 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return 0

    async def supervise(self, now: float) -> None:
        """One pass: note new deaths (and when each restarts), start those that are due."""
        for child in self.children:
            if child.proc.returncode is None:
                continue
            if child.restart_at is None:
                ran = now - child.started
                child.streak = 1 if ran >= STABLE_S else child.streak + 1
                delay = restart_delay(
                    child.streak, self.s.restart_backoff_s, self.s.restart_backoff_max_s
                )
                child.restart_at = now + delay
                log.error(
                    "%s (pid %d) exited with code %s after %.1fs; restarting it in %.1fs",
                    child.name,
                    child.proc.pid,
                    child.proc.returncode,
                    ran,
                    delay,
                )
            elif now >= child.restart_at:
                child.proc = await self._exec(child.name, child.role, child.args, child.env)
                child.started, child.restart_at = now, None
                child.restarts += 1
                log.warning(
                    "%s restarted (pid %d, restart %d)", child.name, child.proc.pid, child.restarts
                )
        await self._supervise_nats()

    async def _supervise_nats(self) -> None:
        """The embedded nats-server comes back on the same port and JetStream store, so
        every service reconnects to the URL it has and the KV event stream survives."""
        if self.nats is None or self.nats.proc is None or self.nats.proc.poll() is None:
            return
        log.error(
            "nats-server (pid %d) exited with code %s; restarting it on %s",
            self.nats.proc.pid,
            self.nats.proc.returncode,
            self.nats_url,
        )
        self.nats.port = int(self.nats_url.rsplit(":", 1)[1])
        try:
            await asyncio.to_thread(self.nats.start)
        except (RuntimeError, TimeoutError, OSError) as exc:  # e.g. the port not free yet
            log.warning("nats-server did not start again (%s); trying again", exc)

    async def stop(self) -> None:
        for role in STOP_ORDER:
            group = [c for c in self.children if c.role == role and c.proc.returncode is None]
            for child in group:
                child.proc.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    await asyncio.wait_for(child.proc.wait(), 20)
                except TimeoutError:
                    log.warning("%s did not stop in 20s; killing it", child.name)
                    child.proc.kill()
                    await child.proc.wait()
        if self.nats is not None:
            self.nats.stop()


def _banner(s: UpSettings, cluster: LocalCluster) -> str:
    lines = [
        "",
        "Halfmoon is up.",
        f"  API      http://{s.host}:{s.port}/v1   (OpenAI-compatible; model: see /v1/models)",
    ]
    if s.console:
        lines.append(f"  console  http://{s.host}:{s.console_port}")
    lines += _metrics_lines(s, cluster)
    lines += [
        f"  NATS     {cluster.nats_url}",
        f"  SQL      {db.resolve_url(cluster.database_url).split('@')[-1]}",
        f"  workers  {_workers(s)}",
        f"  engines  {_engines(s)}",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def _metrics_lines(s: UpSettings, cluster: LocalCluster) -> list[str]:
    urls = [(f"http://{s.host}:{s.port}/metrics", "gateway")]
    urls += [
        (f"http://{s.host}:{port}/metrics", name) for name, port in cluster.metrics_ports.items()
    ]
    return [
        f"  {'metrics' if i == 0 else '':8} {url} ({name})" for i, (url, name) in enumerate(urls)
    ]


def _engines(s: UpSettings) -> str:
    """The dtype and kernels each engine picks on this CPU, and why."""
    info = cpu.detect()
    dtype, why = cpu.resolve_dtype(s.dtype)
    capped = f", capped by {cpu.ISA_ENV}={info.isa}" if info.isa != "native" else ""
    return (
        f"{dtype} ({why}), quantization {s.quantization}; CPU {info.model}: "
        f"kernels for {info.level}{capped}"
    )


def _workers(s: UpSettings) -> str:
    if s.colocated:
        return f"{s.colocated} colocated (prefill + decode each), policy {s.policy}"
    return f"{s.prefill} prefill, {s.decode} decode, policy {s.policy}"


async def run(s: UpSettings) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    cluster = LocalCluster(s)
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
    s = parse_settings(
        UpSettings, argv, "halfmoon up", "Start the whole local cluster on embedded defaults."
    )
    setup_logging(s.log_level, "up")
    try:
        return asyncio.run(run(s))
    except KeyboardInterrupt:
        return 130
