"""The machine's limits, measured in the same run as the workloads they bound.

- Memory read bandwidth: a prefetched read loop (the native kernel's, or torch's sum
  without a compiler) over a buffer the size of the weights and no smaller than 1 GiB,
  best of a few passes: what a decode step's weight stream can get at most.
- Peak matmul: the best of a few large square matmuls in the dtype (int8: torch._int_mm).
On a CUDA device the same two: a sum over a buffer in device memory, and the device's
matmuls (synchronized before each clock is read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.engine import kernels


@dataclass(frozen=True)
class Limits:
    bandwidth_bytes_s: float
    peak_flops: dict[str, float]  # "float32" / "bfloat16" / "int8" -> FLOP/s (int8: OP/s)
    threads: int

    def as_dict(self) -> dict[str, float]:
        return {
            "read_bandwidth_gb_s": self.bandwidth_bytes_s / 1e9,
            "threads": self.threads,
            **{f"peak_{k}_gflop_s": v / 1e9 for k, v in self.peak_flops.items()},
        }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def read_bandwidth(nbytes: int, passes: int = 8, device: str = "cpu") -> float:
    n = max(nbytes, 1 << 30) // 4
    buf = torch.ones(n, dtype=torch.float32, device=device)
    native = device == "cpu" and kernels.available()
    best = float("inf")
    for _ in range(passes + 1):  # the first pass warms up (pages, a CUDA kernel's load)
        _sync(device)
        t0 = time.perf_counter()
        if native:
            kernels.lib().read_bandwidth_sum(buf.data_ptr(), n, torch.get_num_threads())
        else:
            buf.sum().item()
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def peak_matmul(dtype: str, n: int = 2048, passes: int = 5, device: str = "cpu") -> float:
    if device.startswith("cuda"):
        n = max(n, 8192)  # smaller products leave an H100-class device mostly idle
    if dtype == "int8":
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        run = lambda: torch._int_mm(a, b)  # noqa: E731
    else:
        dt = getattr(torch, dtype)
        a = torch.randn(n, n, dtype=dt, device=device)
        b = torch.randn(n, n, dtype=dt, device=device)
        run = lambda: a @ b  # noqa: E731
    run()
    best = float("inf")
    for _ in range(passes):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure(weight_bytes: int, dtypes: list[str], device: str = "cpu") -> Limits:
    return Limits(
        read_bandwidth(weight_bytes, device=device),
        {d: peak_matmul(d, device=device) for d in dtypes},
        torch.get_num_threads(),
    )
