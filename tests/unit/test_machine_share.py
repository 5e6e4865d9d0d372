"""bench replay --sim's share of the cores: the busy time it reads is the machine's own
(psutil), and the background is what the engines' steps did not use."""

import os
import time

import pytest

from services.tools.bench.replay.machine import CpuMark, busy_cpu_s, core_use


def test_the_cores_busy_time_counts_this_process_burning_cpu():
    cpus = os.sched_getaffinity(0)  # this process runs on these only
    wall0, busy0, mine0 = time.monotonic(), busy_cpu_s(cpus), time.process_time()
    while time.process_time() < mine0 + 0.5:
        pass
    busy, mine = busy_cpu_s(cpus) - busy0, time.process_time() - mine0
    wall = time.monotonic() - wall0
    # Whatever else ran, the cores were busy at least while this process computed (the
    # kernel counts in ticks of 10 ms), and at most all of them all the time.
    assert mine - 0.05 <= busy <= (wall + 0.05) * len(cpus), (busy, mine, wall)


def test_the_background_is_the_busy_time_the_engines_steps_did_not_use():
    before = CpuMark(wall_s=100.0, busy_s=1_000.0, work_s=50.0)
    after = CpuMark(wall_s=110.0, busy_s=1_015.0, work_s=62.0)  # 10 s: 15 busy, 12 steps
    use = core_use(before, after)
    assert use.busy_cores == pytest.approx(1.5) and use.work_cores == pytest.approx(1.2)
    assert use.background_cores == pytest.approx(0.3)
    # heartbeats late by a step can put the work a hair above the busy time: never < 0
    assert core_use(before, CpuMark(110.0, 1_010.0, 62.0)).background_cores == 0.0
    assert core_use(before, before).busy_cores == 0.0
