"""One OpenMP team per engine process: the engine thread's.

Why: OpenMP (libgomp, the runtime torch ships and the native kernels share) gives every
thread that starts a parallel region a team of worker threads of its own, kept for the
thread's life. Once a process's OpenMP threads outnumber its CPUs, libgomp cuts the
spin-wait between parallel regions to about a thousand turns, so each of a decode step's
~150 regions wakes its workers through the kernel instead. An engine process had three
teams (the thread that loaded the model, the main thread's, the engine thread's), and a
one-stream fp32 decode step on 2 cores took 30 ms instead of 21 (Intel Xeon, 2026-12-07).

So the engine thread alone runs regions on several threads (engine_thread), and every
other thread of an engine process runs its own alone (serial): the main thread, KV export
and import. Threads that exit take their team with them, so loading the model on a
thread of its own that ends is fine.

The team size is a per-thread OpenMP setting (omp_set_num_threads), which torch overwrites
once per thread on that thread's first torch op (with its global torch.set_num_threads
value); serial() lets torch do that first, then sets 1.
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# Runtimes torch may load: GNU (Linux wheels), Intel's, LLVM's.
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime mapped into this process (torch loads it), or None: no /proc
    (not Linux) or torch built without OpenMP, where there is nothing to set."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if path.startswith("/") and os.path.basename(path).startswith(_RUNTIMES):
            return ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
    return None


def _set_team(threads: int) -> None:
    lib = _runtime()
    if lib is not None:
        lib.omp_set_num_threads(ctypes.c_int(threads))


def serial() -> None:
    """The calling thread runs its parallel regions alone and never starts a team."""
    torch.get_num_threads()  # torch's once-per-thread setting first, so ours holds
    _set_team(1)


def engine_thread(threads: int) -> None:
    """The calling thread is the engine's: its team has `threads` threads (0: torch's
    default). torch.set_num_threads also sets the thread pools torch keeps beside OpenMP."""
    if threads > 0:
        torch.set_num_threads(threads)


def team_size() -> int:
    """The calling thread's team size (what the native kernels are given)."""
    return torch.get_num_threads()


def engine_executor(threads: int) -> ThreadPoolExecutor:
    """The engine's one thread, its team `threads` wide (0: torch's default)."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="engine", initializer=engine_thread, initargs=(threads,)
    )


def serial_executor(name: str) -> ThreadPoolExecutor:
    """One thread beside the engine's (KV export, import) that starts no team."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=serial)
