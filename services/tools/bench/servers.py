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
from pathlib import Path
from typing import Any

from services.tools.bench.placement import Placement, all_gone, free_port, observe, process_tree
from shared.lifecycle import child_preexec

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
            if not all_gone(tree, deadline):
                for pid in tree:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                all_gone(tree, time.monotonic() + 10.0)
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
            "--metrics-base-port",  # not read here; fixed ports would clash with a running up
            "0",
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
        flags: list[str] | None = None,
    ) -> None:
        """`flags`: more of llama-server's (speculation: --spec-type ngram-simple)."""
        self.exe, self.gguf, self.kind, self.slot_ctx = exe, gguf, kind, slot_ctx
        self.flags = list(flags or [])
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
        argv = server_argv(self.exe, self.gguf, self.port, threads, self.parallel, self.slot_ctx)
        return argv + self.flags


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
