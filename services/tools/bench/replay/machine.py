"""What the rest of a one-machine stack takes of its cores during a run (bench replay --sim).

The simulator shares the cores among its engines, pricing their steps with a model fit
on the engines' CPU time. Everything else competes for the same cores: the gateway, the
conductor, the KV manager, the bus, the benchmark's own client, and the engine
processes' threads beside their steps (the handoff's copies and fetches, heartbeats). On
a 2-core stack that was a fifth of a core at 2-2.7 requests/s, about 75 ms of CPU per
request, and the engines' queues, which TTFT is made of, grow with every bit of it.

So over the live run this measures the cores' busy time (all of it, whoever ran:
psutil's per-CPU times, steal included) and the engines' step CPU (their heartbeats'
work_cpu_s). The rest, per request, is the work the simulator adds as each request
arrives (SimConfig.background_s_per_request): that work comes with requests, in their
bursts. And it runs ahead of the engines: `halfmoon up` starts them niced (10 by
default), and the kernel's fair scheduler weighs a process 1.25x per nice level, so the
rest of the stack weighs 1.25^10 = 9.3x an engine (SimConfig.background_weight, from
the niceness of the live processes).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil

# Time a CPU spent on nothing: the rest (user, nice, system, irq, softirq, steal) is busy.
_IDLE = ("idle", "iowait")
_COUNTED = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# The fair scheduler's weight ratio between adjacent nice levels (sched_prio_to_weight).
NICE_STEP = 1.25
ENGINES = ("prefill", "decode")
CONTROL = ("gateway", "conductor", "kvmanager")


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


def background_weight(state: dict[str, Any]) -> float:
    """How much the rest of the stack weighs against an engine in the kernel's fair
    scheduler: 1.25 per nice level the engines run below the gateway, conductor and KV
    manager. 1.0 when those processes cannot be read here (another machine's)."""
    nice: dict[str, list[int]] = {}
    for info in state["instances"]:
        try:
            nice.setdefault(info["role"], []).append(psutil.Process(int(info["pid"])).nice())
        except (psutil.Error, KeyError, ValueError):
            continue
    engines = [n for role in ENGINES for n in nice.get(role, [])]
    control = [n for role in CONTROL for n in nice.get(role, [])]
    if not engines or not control:
        return 1.0
    return float(NICE_STEP ** (statistics.mean(engines) - statistics.mean(control)))


@dataclass(frozen=True)
class CpuMark:
    wall_s: float  # time.monotonic()
    busy_s: float
    work_s: float


def mark_of(state: dict[str, Any]) -> CpuMark:
    """A mark now, with the engines' step time from a GET /admin/state just read."""
    return CpuMark(time.monotonic(), busy_cpu_s(), work_cpu_s(state))


def split_of(state: dict[str, Any]) -> tuple[int, int]:
    """(prefill, decode) engine instances in a GET /admin/state, by the role each serves
    (one switching counts in the role it leaves: it reports that until it is done)."""
    roles = [i["role"] for i in state["instances"]]
    return roles.count("prefill"), roles.count("decode")


async def mark_after(url: str, timeout_s: float = 10.0) -> tuple[CpuMark, dict[str, Any]]:
    """A mark once every engine has sent a heartbeat after this call (so its steps up to
    now are counted), and that /admin/state: the busy time is read at the call, before
    the wait."""
    wall, busy, asked = time.monotonic(), busy_cpu_s(), time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        state = await admin_state(url)
        engines = [i for i in state["instances"] if i["role"] in ENGINES]
        if all(i["sent_at"] >= asked for i in engines) or time.monotonic() > deadline:
            return CpuMark(wall, busy, work_cpu_s(state)), state
        await asyncio.sleep(0.1)


@dataclass(frozen=True)
class CoreUse:
    """Cores' worth of CPU over a run, on average: all busy time, the engines' steps, and
    the rest (what the simulator adds as the background's work)."""

    span_s: float
    busy_cores: float
    work_cores: float

    @property
    def background_cores(self) -> float:
        return max(0.0, self.busy_cores - self.work_cores)

    def background_s_per_request(self, requests: int) -> float:
        return self.background_cores * self.span_s / requests if requests else 0.0


def core_use(before: CpuMark, after: CpuMark) -> CoreUse:
    span = after.wall_s - before.wall_s
    if span <= 0:
        return CoreUse(0.0, 0.0, 0.0)
    return CoreUse(
        span, (after.busy_s - before.busy_s) / span, (after.work_s - before.work_s) / span
    )  # fmt: skip
