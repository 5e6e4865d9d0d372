"""Where a benchmarked system runs and what ran where: the CPU set its whole process tree is
pinned to and the threads of each process (`Placement`), and the tree read back from /proc
(what `bench serve`'s banner reports, and what a server's stop waits for)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.cpus import parse_cpus as cpu_list


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
    cpus = cpu_list(spec)
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


def all_gone(pids: list[int], deadline: float) -> bool:
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
