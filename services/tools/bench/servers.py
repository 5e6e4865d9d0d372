"""Servers the serving benchmark starts itself: Halfmoon's local stack, llama.cpp's
`llama-server`, `transformers serve`.

Every server runs on a `Placement`: the CPU set its whole process tree is pinned to (the
affinity is set in the child before exec, and children inherit it) and the compute threads
of each of its processes. Both sides get the same cores and the same threads in total:
Halfmoon's engines share them out (cores // engines each, as `halfmoon up` does, but from the
pinned set: `up` itself counts every core of the machine), and transformers serve, one
process, gets that total through OMP_NUM_THREADS, and llama-server, one process, as its
--threads and --threads-batch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.lifecycle import child_preexec


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- where a system runs ----------------------------------------------------------------


def parse_cpus(spec: str) -> tuple[int, ...]:
    """ "0-3,6" -> (0, 1, 2, 3, 6); "" -> every core this process may run on."""
    if not spec.strip():
        return tuple(sorted(os.sched_getaffinity(0)))
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {spec!r}")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(
            f"CPUs {format_cpus(tuple(sorted(cpus - allowed)))} are not available "
            f"to this process (it may use {format_cpus(tuple(sorted(allowed)))})"
        )
    return tuple(sorted(cpus))


def format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5", the form taskset and /proc use."""
    runs: list[str] = []
    xs = sorted(cpus)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        runs.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(runs)


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]  # every process of the system is pinned to these
    processes: int  # processes that compute (engines; transformers serve: 1)
    threads: int  # torch / OpenMP threads of each of them

    @property
    def total_threads(self) -> int:
        return self.processes * self.threads

    def env(self) -> dict[str, str]:
        """OpenMP pools sized to the thread budget in every process of the tree (torch reads
        OMP_NUM_THREADS at start), and no tokenizer thread pool on top of it."""
        n = str(self.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cpus": format_cpus(self.cpus), "total_threads": self.total_threads}


def halfmoon_layout(extra: list[str]) -> tuple[int, int]:
    """(engine processes, threads each if set in `extra`, else 0), as `halfmoon up` would read
    its flags (and HALFMOON_* env vars) for this run."""
    from services.up import UpSettings
    from shared.settings import parse_settings

    s = parse_settings(UpSettings, extra, "halfmoon up (--halfmoon-args)")
    engines = s.colocated or s.prefill + s.decode
    return engines, s.threads


def placements(cpus: tuple[int, ...], halfmoon_extra: list[str]) -> tuple[Placement, Placement]:
    """(Halfmoon's, transformers serve's): the same cores, the same threads in total."""
    engines, threads = halfmoon_layout(halfmoon_extra)
    halfmoon = Placement(cpus, engines, threads or max(1, len(cpus) // engines))
    return halfmoon, Placement(cpus, 1, halfmoon.total_threads)


# --- what actually ran where (read back from /proc) -------------------------------------


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, nice) from /proc/PID/stat; the name may hold spaces and parentheses."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[16])


def process_tree(root: int) -> list[int]:
    """root and all its descendants alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(_stat(int(entry))[0], []).append(int(entry))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(out)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie that only waits for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _all_gone(pids: list[int], deadline: float) -> bool:
    """Polls until every one of `pids` has exited, or `deadline` (monotonic) passes."""
    while not all(_gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _name(pid: int) -> str:
    """A short name: the executable, or for Python the module (-m) or script it runs."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if not argv:
        return "?"
    exe = Path(argv[0]).name
    if not exe.startswith("python"):
        return exe
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    scripts = [Path(a).name for a in argv[1:] if a.startswith("/") and "\n" not in a]
    return scripts[0] if scripts else exe


def observe(root: int) -> list[dict[str, Any]]:
    """Each process of the tree: its name, the CPUs it may run on, its OS threads, its nice."""
    seen = []
    for pid in process_tree(root):
        try:
            status = dict(
                line.split(":\t", 1)
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line
            )
            seen.append(
                {
                    "pid": pid,
                    "name": _name(pid),
                    "nice": _stat(pid)[1],
                    "cpus": status["Cpus_allowed_list"].strip(),
                    "os_threads": int(status["Threads"]),
                }
            )
        except (OSError, KeyError, ValueError):
            continue
    return seen


# --- the servers ------------------------------------------------------------------------


class Server:
    name = "server"
    has_ready_line = False  # else /health answering means ready
    prefix_cache = "none"  # what it reuses across requests: none, or how
    reports_cached_tokens = False  # usage.prompt_tokens_details.cached_tokens is real
    # How a request asks for exactly max_tokens (see serve.workload.body), and what else it
    # carries.
    eos_style = "ignore_eos"
    request_extra: dict[str, Any] = {}
    # Started again at each concurrency level (its slots are sized to the level).
    restarts_per_level = False
    precision = ""  # the precision it runs at, as `bench serve --precisions` names them

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        placement: Placement,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir, self.dtype, self.placement = model_dir, dtype, placement
        self.extra, self.env = extra or [], env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []
        self._ready = threading.Event()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"hm-bench-{self.name}-"))

    def command(self) -> list[str]:
        raise NotImplementedError

    def at_concurrency(self, n: int) -> None:
        """Get ready to serve n concurrent requests (servers that restart per level)."""

    def launch_env(self) -> dict[str, str]:
        return dict(
            os.environ,
            HALFMOON_HOME=str(self.tmp / "home"),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            **self.placement.env(),
            **self.env,
        )

    def ready_line(self, line: str) -> bool:
        return False

    def _preexec(self) -> None:
        """In the child, before exec: pinned (its descendants inherit it), its own process
        group (stopped as a whole), and gone if the bench dies."""
        os.sched_setaffinity(0, self.placement.cpus)
        child_preexec()

    def start(self, timeout_s: float = 300) -> None:
        self.proc = subprocess.Popen(
            self.command(),
            env=self.launch_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=self._preexec,
        )
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

    def observe(self) -> list[dict[str, Any]]:
        return observe(self.proc.pid) if self.proc and self.proc.poll() is None else []

    def _pump(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            self.log.append(line)
            if self.ready_line(line):
                self._ready.set()

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the server's process group; return once its whole process tree is gone
        (SIGKILL for what is left after `timeout_s`): the bench starts the next server on
        these cores only when this one has let go of them. Tree, not group: `halfmoon up`
        puts each child in a group of its own, and stops them itself."""
        if self.proc and self.proc.poll() is None:
            tree = process_tree(self.proc.pid)
            deadline = time.monotonic() + timeout_s
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            if not _all_gone(tree, deadline):
                for pid in tree:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                _all_gone(tree, time.monotonic() + 10.0)
        shutil.rmtree(self.tmp, ignore_errors=True)


class HalfmoonServer(Server):
    name = "halfmoon"
    has_ready_line = True  # the gateway answers /health before the workers are ready
    prefix_cache = "hashed KV blocks, reused across requests"
    reports_cached_tokens = True

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        placement: Placement,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        quantization: str = "none",
    ) -> None:
        self.quantization = quantization
        super().__init__(model_dir, dtype, placement, extra, env)

    def command(self) -> list[str]:
        # --threads explicitly: `up` would divide every core of the machine, not the pinned set.
        return [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--no-console",
            "--port",
            str(self.port),
            "--model",
            str(self.model_dir),
            "--dtype",
            self.dtype,
            "--threads",
            str(self.placement.threads),
            *(["--quantization", self.quantization] if self.quantization != "none" else []),
            *self.extra,
        ]

    def ready_line(self, line: str) -> bool:
        return "Halfmoon is up." in line


class TransformersServer(Server):
    eos_style = "generation_config"  # it refuses fields it does not know, ignore_eos included

    def __init__(
        self, model_dir: Path, dtype: str, placement: Placement, continuous_batching: bool
    ) -> None:
        self.cb = continuous_batching
        self.name = "transformers-serve" + ("-cb" if continuous_batching else "")
        # transformers 5.x: continuous batching keeps finished requests' full blocks for reuse
        # (ContinuousBatchingConfig.allow_block_sharing, on by default); without it, nothing.
        self.prefix_cache = (
            "finished requests' full blocks, shared (transformers' default)" if self.cb else "none"
        )
        super().__init__(model_dir, dtype, placement)

    def command(self) -> list[str]:
        exe = Path(sys.executable).with_name("transformers")
        cb = ["--continuous-batching"] if self.cb else []
        return [
            *torch_launch(exe, self.placement.threads),
            "serve",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--device",
            "cpu",
            *cb,
        ]


class LlamaCppServer(Server):
    """llama.cpp's llama-server on one GGUF, with one slot per concurrent request: it is
    started again at each level with --parallel equal to the concurrency (and the context
    to match), as someone serving that load would run it."""

    # /health answers 503 while the model loads and 200 once it serves.
    prefix_cache = (
        "each slot keeps its last prompt's KV and a request goes to the slot it shares most "
        "with (cache_prompt), plus llama.cpp's default host-RAM prompt cache"
    )
    reports_cached_tokens = True
    request_extra = {"cache_prompt": True}
    restarts_per_level = True

    def __init__(
        self,
        model_dir: Path,
        exe: Path,
        gguf: Path,
        kind: str,
        placement: Placement,
        slot_ctx: int,
    ) -> None:
        self.exe, self.gguf, self.kind, self.slot_ctx = exe, gguf, kind, slot_ctx
        self.name = f"llama.cpp-{kind}"
        self.parallel = 1
        super().__init__(model_dir, kind, placement)

    def at_concurrency(self, n: int) -> None:
        """Slots for n concurrent requests, from the next start() on (on a new port: the
        last one may linger)."""
        self.parallel = n
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        from services.tools.bench.llama_cpp import server_argv

        threads = self.placement.total_threads
        return server_argv(self.exe, self.gguf, self.port, threads, self.parallel, self.slot_ctx)


# torch caps OMP_NUM_THREADS at the core count when it starts, but Halfmoon's engines may
# hold more threads in total than there are cores (torch.set_num_threads is not capped).
_LAUNCH = (
    "import runpy, sys, torch; torch.set_num_threads(int(sys.argv.pop(1))); "
    "sys.argv[0] = sys.argv.pop(1); runpy.run_path(sys.argv[0], run_name='__main__')"
)


def torch_launch(script: Path, threads: int) -> list[str]:
    """Run a Python console script (here `transformers`) with exactly `threads` torch threads."""
    return [sys.executable, "-c", _LAUNCH, str(threads), str(script)]


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False
