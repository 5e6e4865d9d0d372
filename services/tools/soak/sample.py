"""What a soak samples: each process's RSS, descriptors and threads (psutil), the SQL
tables' rows, and the KV event stream's size in JetStream.

For the nats-server, a Go program, also what its runtime says it holds (its profiling
endpoint's MemStats): `Sys`, all the memory it has taken from the OS, and `HeapAlloc`, the
heap in use. A Go process's RSS creeps up for a long while as the runtime touches pages of
arenas it already holds, and its private (anonymous) RSS can never pass `Sys`: a flat `Sys`
is a bounded process, whatever its RSS does within it."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil
from nats.aio.client import Client as NATS
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.kvmanager.stream import STREAM
from shared.db.schema import (
    DecisionRecord,
    InstanceRecord,
    KVBlockRecord,
    LoadSample,
    RequestRecord,
)
from shared.db.session import sessionmaker

TABLES = {
    "requests": RequestRecord,
    "decisions": DecisionRecord,
    "instances": InstanceRecord,
    "load_samples": LoadSample,
    "kv_blocks": KVBlockRecord,
}
MIB = float(1 << 20)


@dataclass
class Samples:
    """Time series by (series name, kind); a process's series are per incarnation (pid),
    each from `warmup_s` after it was first seen: a restarted process grows while it
    warms up, which is no leak."""

    warmup_s: float
    points: dict[tuple[str, str], list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    _first_seen: dict[int, float] = field(default_factory=dict)

    def add(self, series: str, kind: str, t: float, value: float) -> None:
        self.points[(series, kind)].append((t, value))

    def process(self, name: str, pid: int, t: float) -> str | None:
        """Sample one process; its series name, or None (warming up, or gone)."""
        first = self._first_seen.setdefault(pid, t)
        if t - first < self.warmup_s:
            return None
        with contextlib.suppress(psutil.Error):  # it died between listing and reading
            p = psutil.Process(pid)
            with p.oneshot():
                if p.status() == psutil.STATUS_ZOMBIE:  # killed, not reaped yet
                    return None
                mem, fds, threads = p.memory_info(), p.num_fds(), p.num_threads()
            series = f"{name} (pid {pid})"
            self.add(series, "rss_mib", t, mem.rss / MIB)
            # Private pages (what a leak grows); `shared` is file-backed and shared memory.
            self.add(series, "rss_anon_mib", t, (mem.rss - mem.shared) / MIB)
            self.add(series, "fds", t, fds)
            self.add(series, "threads", t, threads)
            return series
        return None


def go_memstats(text: str) -> dict[str, float]:
    """`# Name = value` lines of a Go heap profile (debug=1), the numeric ones."""
    stats: dict[str, float] = {}
    for line in text.splitlines():
        key, sep, value = line.removeprefix("# ").partition(" = ")
        if line.startswith("# ") and sep and value.isdigit():
            stats[key] = float(value)
    return stats


async def sample_go(
    http: aiohttp.ClientSession, prof_url: str, series: str, samples: Samples, t: float
) -> None:
    """A Go program's own accounting, from its profiling endpoint."""
    async with http.get(f"{prof_url}/debug/pprof/heap?debug=1") as resp:
        stats = go_memstats(await resp.text())
    samples.add(series, "go_sys_mib", t, stats["Sys"] / MIB)
    samples.add(series, "go_heap_mib", t, stats["HeapAlloc"] / MIB)


def cluster_processes(cluster: Any) -> list[tuple[str, int]]:
    """(name, pid) of every live process of a LocalCluster, its nats-server included."""
    out = [(c.name, c.proc.pid) for c in cluster.children if c.proc.returncode is None]
    proc = cluster.nats.proc if cluster.nats is not None else None
    if proc is not None and proc.poll() is None:
        out.append(("nats-server", proc.pid))
    return out


async def sample_sql(engine: AsyncEngine, samples: Samples, t: float) -> None:
    async with sessionmaker(engine)() as s:
        for name, table in TABLES.items():
            rows = (await s.execute(select(func.count()).select_from(table))).scalar_one()
            samples.add(f"sql {name}", "rows", t, rows)


async def sample_jetstream(nc: NATS, samples: Samples, t: float) -> None:
    info = await nc.jetstream().stream_info(STREAM)
    samples.add("jetstream HALFMOON_KV", "jetstream_msgs", t, info.state.messages)
    samples.add("jetstream HALFMOON_KV", "jetstream_mib", t, info.state.bytes / MIB)
