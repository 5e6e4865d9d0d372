"""What the rest of a one-machine stack takes of its cores during a run (bench replay --sim).

The simulator shares the cores among its engines, pricing their steps with a model fit
on the engines' CPU time. Everything else competes for the same cores: the gateway, the
conductor, the KV manager, the bus, the benchmark's own client, and the engine
processes' threads beside their steps (the handoff's copies and fetches, heartbeats). On
a 2-core stack that was a fifth of a core at 2-2.7 requests/s, and the engines' queues,
which TTFT is made of, grow with every bit of it. So over the live run this measures the
cores' busy time (all of it, whoever ran: psutil's per-CPU times, steal included) and
the engines' step CPU (their heartbeats' work_cpu_s); the difference per second of the
run is the background the simulator takes out of the engines' share
(SimConfig.background_cores): its average, as the simulator has no finer model of it.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil

# Time a CPU spent on nothing: the rest (user, nice, system, irq, softirq, steal) is busy.
_IDLE = ("idle", "iowait")
_COUNTED = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def busy_cpu_s(cpus: set[int] | None = None) -> float:
    """Busy CPU seconds since boot on `cpus` (default: the ones this process may use)."""
    cpus = cpus if cpus is not None else os.sched_getaffinity(0)
    total = 0.0
    for i, t in enumerate(psutil.cpu_times(percpu=True)):
        if i in cpus:
            total += sum(getattr(t, f, 0.0) for f in _COUNTED if f not in _IDLE)
    return total


async def admin_state(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/admin/state") as resp:
            resp.raise_for_status()
            state: dict[str, Any] = await resp.json()
            return state


def work_cpu_s(state: dict[str, Any]) -> float:
    """The engines' step CPU seconds so far, from their last heartbeats."""
    return sum(float(i.get("work_cpu_s", 0.0)) for i in state["instances"])


@dataclass(frozen=True)
class CpuMark:
    wall_s: float  # time.monotonic()
    busy_s: float
    work_s: float


async def mark(url: str) -> CpuMark:
    return CpuMark(time.monotonic(), busy_cpu_s(), work_cpu_s(await admin_state(url)))


async def mark_after(url: str, timeout_s: float = 10.0) -> CpuMark:
    """A mark once every engine has sent a heartbeat after this call (so its steps up to
    now are counted): the busy time is read at the call, before the wait."""
    wall, busy, asked = time.monotonic(), busy_cpu_s(), time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        state = await admin_state(url)
        engines = [i for i in state["instances"] if i["role"] in ("prefill", "decode")]
        if all(i["sent_at"] >= asked for i in engines) or time.monotonic() > deadline:
            return CpuMark(wall, busy, work_cpu_s(state))
        await asyncio.sleep(0.1)


@dataclass(frozen=True)
class CoreUse:
    """Cores' worth of CPU over a run, on average: all busy time, the engines' steps, and
    the rest (what the simulator takes out of the engines' share)."""

    busy_cores: float
    work_cores: float

    @property
    def background_cores(self) -> float:
        return max(0.0, self.busy_cores - self.work_cores)


def core_use(before: CpuMark, after: CpuMark) -> CoreUse:
    span = after.wall_s - before.wall_s
    if span <= 0:
        return CoreUse(0.0, 0.0)
    return CoreUse(
        (after.busy_s - before.busy_s) / span, (after.work_s - before.work_s) / span
    )  # fmt: skip
