"""One OpenMP team per engine process (shared/engine/omp.py): a serial thread's parallel
torch op starts no worker threads, the engine thread's does, and an engine process's
start-up leaves its main thread serial. Each check runs in a fresh interpreter, since a
team, once started, lives as long as its thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc"),
    pytest.mark.skipif(
        "OpenMP" not in torch.__config__.parallel_info(), reason="torch without OpenMP"
    ),
]

# A parallel op (well above torch's grain of 32,768 elements) and the process's threads.
PRELUDE = """
import os, threading
from concurrent.futures import ThreadPoolExecutor
import torch
from shared.engine import omp

def threads():
    return len(os.listdir("/proc/self/task"))

def parallel_op():
    x = torch.ones(4_000_000)
    return float((x * 2).sum())

def workers_started(fn):
    '''Threads a call to fn left behind (an OpenMP team outlives the region).'''
    before = threads()
    fn()
    return threads() - before
"""


def run(body: str) -> str:
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_serial_thread_starts_no_team_and_the_engine_thread_does() -> None:
    out = run(
        """
        torch.set_num_threads(2)  # torch's global: every new thread takes it at first use
        omp.serial()
        assert torch.get_num_threads() == 1
        serial = workers_started(parallel_op)
        engine = ThreadPoolExecutor(1, initializer=omp.engine_thread, initargs=(2,))
        engine.submit(lambda: None).result()  # the thread itself, before counting
        team = workers_started(lambda: engine.submit(parallel_op).result())
        size = engine.submit(omp.team_size).result()
        side = ThreadPoolExecutor(1, initializer=omp.serial)
        side.submit(lambda: None).result()
        beside = workers_started(lambda: side.submit(parallel_op).result())
        print(serial, team, size, beside)
        """
    )
    serial, team, size, beside = (int(x) for x in out.split())
    assert (serial, beside) == (0, 0), "a serial thread started an OpenMP team"
    assert (team, size) == (1, 2), "the engine thread's 2-thread team: one worker beside it"


def test_an_engine_process_start_up_leaves_its_main_thread_serial(model_dir: Path) -> None:
    out = run(
        f"""
        import asyncio
        from services.worker.bootstrap import load_for
        from services.worker.settings import WorkerSettings

        settings = WorkerSettings(model={str(model_dir)!r}, dtype="float32", threads=2)
        lm = asyncio.run(load_for(settings, "prefill"))
        assert lm.name
        print(torch.get_num_threads(), workers_started(parallel_op))
        """
    )
    size, started = (int(x) for x in out.split())
    assert (size, started) == (1, 0), "the main thread of an engine process has a team"
