"""The machine's limits, measured in the same run as the workloads they bound.

- Memory read bandwidth: a prefetched read loop (the native kernel's, or torch's sum
  without a compiler) over a buffer the size of the weights and no smaller than 1 GiB,
  best of a few passes: what a decode step's weight stream can get at most.
- Peak matmul, per precision, with the kernels the engine runs: the best of a few large
  square products through the engine's own linear layer (its bf16 GEMM, or the library
  GEMM it hands many rows to) and the library's matmul in the dtype, whichever is faster.
  For int8 that is the engine's weight-only int8 linear at many rows, which multiplies
  the dequantized weights in the activation dtype: W8A8 integer products
  (torch._int_mm, `int8_w8a8`) are timed too, for reference, but no engine path runs
  them (quantized activations failed the quality gate), so they bound nothing.
On a CUDA device the same two: a sum over a buffer in device memory, and the device's
matmuls (synchronized before each clock is read).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine import kernels


@dataclass(frozen=True)
class Limits:
    bandwidth_bytes_s: float
    # "float32" / "bfloat16" / "int8" (the engine's weight-only int8) -> FLOP/s; and
    # "int8_w8a8" (integer products, OP/s) for reference: no engine path runs them
    peak_flops: dict[str, float]
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
    """The library's square matmul in `dtype` (int8: W8A8 torch._int_mm), FLOP/s."""
    if device.startswith("cuda"):
        n = max(n, 8192)  # smaller products leave an H100-class device mostly idle
    if dtype == "int8":
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        return _flops(n, lambda: torch._int_mm(a, b), passes, device)
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, dtype=dt, device=device)
    b = torch.randn(n, n, dtype=dt, device=device)
    return _flops(n, lambda: a @ b, passes, device)


def engine_linear_peak(precision: str, act_dtype: str, n: int = 2048, passes: int = 5) -> float:
    """The engine's own linear layer (`precision`: "dense" or "int8") on an n x n weight
    in `act_dtype`, at n rows: the kernels a full decode batch or a prefill chunk runs."""
    from shared.engine.linear import DenseLinear, Int8Linear

    dt = getattr(torch, act_dtype)
    weight = torch.randn(n, n).mul_(n**-0.5).to(dt)
    linear = Int8Linear(weight) if precision == "int8" else DenseLinear(weight)
    x = torch.randn(n, n).to(dt)
    return _flops(n, lambda: linear(x), passes, "cpu")


def _flops(n: int, run: Callable[[], object], passes: int, device: str) -> float:
    run()
    best = float("inf")
    for _ in range(passes):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peaks(
    dtypes: list[str], int8_act: str | None, device: str = "cpu", n: int = 2048
) -> dict[str, float]:
    """Each precision's peak with the kernels the engine runs (see the module's note):
    `dtypes` dense, and int8 (weight-only, activations in `int8_act`) where asked."""
    out: dict[str, float] = {}
    for d in dtypes:
        out[d] = peak_matmul(d, n, device=device)
        if device == "cpu":
            out[d] = max(out[d], engine_linear_peak("dense", d, n))
    if int8_act is not None and device == "cpu":
        out["int8"] = engine_linear_peak("int8", int8_act, n)
        out["int8_w8a8"] = peak_matmul("int8", n)
    return out


def measure(
    weight_bytes: int, dtypes: list[str], int8_act: str | None, device: str = "cpu"
) -> Limits:
    return Limits(
        read_bandwidth(weight_bytes, device=device),
        peaks(dtypes, int8_act, device),
        torch.get_num_threads(),
    )
