"""Which attention a prefill chunk runs on the native path: the paged kernel that reads
K and V in place (csrc/prefill_attention.c), or torch SDPA over the gathered KV.

The paged kernel is plain AVX2/AVX-512 FMA code. On a CPU with AMX, torch's bf16 SDPA
runs on the tile units (oneDNN) and wins once a chunk has enough queries to fill the
tiles. Measured with the default model's shape (9 query heads, 3 KV heads, dim 64),
2 threads, on an Intel Xeon with AMX, native / SDPA GFLOP/s:

    bf16, chunk of 16:   1.3-2.3x   (the kernel wins: too few rows for the tiles)
    bf16, chunk of 64:   0.49-0.86x (SDPA wins)
    bf16, chunk of 512:  0.44-0.54x
    fp32, any chunk:     1.1-2.2x   (no AMX for fp32: the kernel wins)

and on an AVX2 EPYC the kernel wins in fp32 (1.4x). So SDPA is picked for bf16 chunks
of SDPA_MIN_CHUNK queries or more where the CPU has AMX bf16 tiles, and the kernel
everywhere else. HALFMOON_PREFILL_ATTENTION=native|sdpa forces one (benchmarks, tests,
a CPU the rule has not met); `auto` (the default) applies the rule. Both compute the
same attention: logits agree to 1e-4 in fp32 (tests/unit/test_attention_path.py).
"""

from __future__ import annotations

import os

import torch

from shared.engine import cpu

ENV = "HALFMOON_PREFILL_ATTENTION"
MODES = ("auto", "native", "sdpa")
SDPA_MIN_CHUNK = 64


def requested() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def sdpa_min_chunk(dtype: torch.dtype, flags: frozenset[str], mode: str) -> int | None:
    """The fewest queries a chunk needs to run through SDPA (None: never)."""
    if mode == "sdpa":
        return 1
    if mode == "native":
        return None
    if dtype == torch.bfloat16 and "amx_bf16" in flags:
        return SDPA_MIN_CHUNK
    return None


def for_model(dtype: torch.dtype) -> int | None:
    """The rule for this process: its CPU (as HALFMOON_CPU_ISA caps it) and the env."""
    return sdpa_min_chunk(dtype, cpu.detect().flags, requested())


def describe(dtype: torch.dtype) -> str:
    """One line for logs and benches: what a prefill chunk runs here."""
    least = for_model(dtype)
    if least is None:
        return "native paged kernel"
    if least == 1:
        return "SDPA"
    return f"SDPA from {least}-query chunks (AMX bf16), native paged kernel below"
