"""The local cluster `halfmoon up` runs: one process per service, started in order, watched
until ready, supervised (a child that dies starts again after a backoff) and stopped in
order: intake first (gateway), then scheduling, workers, the rest, NATS last."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import nats
from nats.aio.msg import Msg

from services.up.settings import UpSettings
from shared import aio, bus, subjects
from shared.cpus import engine_cpus
from shared.lifecycle import child_preexec
from shared.messages import InstanceInfo
from shared.natsd import EmbeddedNats
from shared.settings import BaseSettings, halfmoon_home, settings_from

log = logging.getLogger("halfmoon.up")
STOP_ORDER = ("gateway", "conductor", "prefill", "decode", "kvmanager", "console")
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

    def expected(self) -> Counter[str]:
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

    def metrics_children(self) -> int:
        """How many children get a /metrics port of their own (all but the gateway)."""
        return sum(self.expected().values()) - 1

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

    def _engine_args(self, model_dir: Path) -> list[str]:
        """Flags every prefill, decode or colocated instance gets."""
        n_prefill, n_decode = self.engines()
        threads = self.s.threads or max(1, (os.cpu_count() or 1) // (n_prefill + n_decode))
        return [
            "--model",
            str(model_dir),
            "--dtype",
            self.s.dtype,
            "--quantization",
            self.s.quantization,
            "--threads",
            str(threads),
            "--nice",
            str(self.s.engine_nice),
            *(["--kv-cache-gb", str(self.s.kv_cache_gb)] if self.s.kv_cache_gb else []),
            *(["--lean-weights"] if self.s.lean_weights else []),
            *self._context_args(),
        ]

    def _decoding_args(self) -> list[str]:
        """Flags for the instances that decode: speculation, where asked for."""
        k = self.s.num_speculative_tokens
        return [] if k is None else ["--num-speculative-tokens", str(k)]

    def _pin(self, index: int) -> list[str]:
        """`--cpus` for engine `index` in start order, with --pin-engines."""
        if not self.s.pin_engines:
            return []
        cores = sorted(os.sched_getaffinity(0))
        n_prefill, n_decode = self.engines()
        threads = self.s.threads or max(1, len(cores) // (n_prefill + n_decode))
        return ["--cpus", engine_cpus(index, threads, cores)]

    def _context_args(self) -> list[str]:
        """The served context, the same on the gateway and every engine."""
        args = ["--max-model-len", str(self.s.max_model_len)] if self.s.max_model_len else []
        return args + (["--rope-scaling", self.s.rope_scaling] if self.s.rope_scaling else [])

    async def start(self, model_dir: Path) -> None:
        n_prefill, n_decode = self.engines()
        common = ["--model", str(model_dir), *self._context_args()]
        engine = self._engine_args(model_dir)
        layout = "colocated" if self.s.colocated else "disaggregated"
        conductor = ["--policy", self.s.policy, "--layout", layout, "--planner", self.s.planner]
        for i in range(self.s.conductors):
            named = ["--instance-id", f"conductor-{i}"] if self.s.conductors > 1 else []
            await self._spawn(
                f"conductor-{i}" if named else "conductor",
                "conductor",
                ["-m", "services.conductor", *named, *conductor],
            )
        await self._spawn("kvmanager", "kvmanager", ["-m", "services.kvmanager"])
        name = "colocated" if self.s.colocated else "prefill"
        own = self._decoding_args() if self.s.colocated else []  # colocated ones decode too
        for i in range(n_prefill):
            await self._spawn(
                f"{name}-{i}",
                "prefill",
                ["-m", "services.prefill", "--instance-id", f"{name}-{i}", *engine, *own]
                + self._pin(i),
            )
        for i in range(n_decode):
            pin = self._pin(n_prefill + i)
            await self._spawn(
                f"decode-{i}",
                "decode",
                [
                    "-m",
                    "services.decode",
                    "--instance-id",
                    f"decode-{i}",
                    *engine,
                    *self._decoding_args(),
                    *pin,
                ],
            )
        tools = ["--tool-format", self.s.tool_format] if self.s.tool_format else []
        gateway = ["--host", self.s.host, "--port", str(self.s.port), *common, *tools]
        await self._spawn("gateway", "gateway", ["-m", "services.gateway", *gateway])
        if self.s.console:
            await self._start_console()

    async def _start_console(self) -> None:
        app = Path(__file__).resolve().parents[2] / "console" / "app.py"
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

        async def on_beat(msg: Msg) -> None:
            info = InstanceInfo.model_validate_json(msg.data)
            seen[info.instance_id] = info.role.value

        # The services read HALFMOON_NATS_USER, _CREDS, _TLS_* from the environment they
        # inherit; this process watches their heartbeats with the same credentials.
        security = bus.security_options(
            settings_from(BaseSettings, overrides={"nats_url": self.nats_url})
        )
        nc = await nats.connect(self.nats_url.split(","), **security)
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
            await aio.wait_set(stop, 0.5)
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
                    async with asyncio.timeout(20):
                        await child.proc.wait()
                except TimeoutError:
                    log.warning("%s did not stop in 20s; killing it", child.name)
                    child.proc.kill()
                    await child.proc.wait()
        if self.nats is not None:
            self.nats.stop()
