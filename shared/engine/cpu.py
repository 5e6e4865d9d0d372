"""What this CPU can do, and the engine's choices that follow from it (dtype, kernels).

Machines differ: some have AVX-512 with native bf16 (or AMX), others only AVX2, others
are aarch64. bf16 without native support is emulated and slow (matmuls at 1-19 GFLOP/s
against about 180 in fp32 on an AVX2 EPYC), and oneDNN refuses to prepack bf16 weights
there. So `--dtype auto` picks bf16 only where the CPU computes it natively.

`HALFMOON_CPU_ISA` caps what is used, to run the lesser paths on a bigger machine (CI
does, so the AVX2 path is tested whatever machine it lands on):
    native   what the CPU has (the default)
    avx512   x86-64 with AVX-512 but no bf16/AMX/VNNI extensions beyond it
    avx2     x86-64-v3: AVX2 + FMA, no AVX-512 (the AVX2 EPYC's level)
    generic  baseline x86-64 / aarch64: no SIMD beyond the architecture's base
It masks the flags this module reports and the -march the native kernels build with.
ATen and oneDNN read their own caps (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`) once,
when torch loads: `isa_env()` gives the values that match, for child processes, and
`services.cli` applies them to its own process before torch is imported.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "HALFMOON_CPU_ISA"
ISAS = ("native", "avx512", "avx2", "generic")
# Flags that make bf16 arithmetic native: AVX-512 BF16, AMX tiles, AVX-NE-CONVERT (x86);
# the BF16 extension (aarch64, "bf16" in /proc/cpuinfo features).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16"})
_AVX512_EXTRAS = (
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "avx512_vbmi",
    "avx512_vbmi2",
    "avx512_bitalg",
    "avx512_vpopcntdq",
    "avx512ifma",
    "avx_vnni",
    "avx_ne_convert",
    "amx",
)
# What each cap leaves for ATen's dispatcher and oneDNN (their own spellings).
_ATEN = {"avx512": "avx512", "avx2": "avx2", "generic": "default"}
_ONEDNN = {"avx512": "AVX512_CORE", "avx2": "AVX2", "generic": "SSE41"}


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str
    flags: frozenset[str]  # after the cap
    isa: str  # the cap in force (one of ISAS)

    @property
    def x86(self) -> bool:
        return self.arch in ("x86_64", "AMD64", "i686")

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & BF16_FLAGS)

    @property
    def level(self) -> str:
        """The SIMD level the kernels build for, in words."""
        if not self.x86:
            return self.arch
        if "avx512f" in self.flags:
            extras = [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16") if f in self.flags]
            return "avx512" + ("+" + "+".join(extras) if extras else "")
        return "avx2" if "avx2" in self.flags else "x86-64"

    def march(self) -> list[str]:
        """Compiler flags for the native kernels: as much of this CPU as the cap allows."""
        if self.isa == "native":
            return ["-mcpu=native"] if self.arch == "aarch64" else ["-march=native"]
        if not self.x86:
            return []  # generic aarch64: the base architecture
        return {
            "avx512": ["-march=skylake-avx512"],
            "avx2": ["-march=x86-64-v3"],
            "generic": ["-march=x86-64"],
        }[self.isa]


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "CPU part") and not model:
            model = value.strip()
        if key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model or "unknown", flags


def _mask(flags: frozenset[str], isa: str) -> frozenset[str]:
    if isa == "native":
        return flags
    if isa in ("avx2", "generic"):
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
        flags -= {"avx_vnni", "avx_ne_convert", "avx_vnni_int8", "avx_ifma"}
    if isa == "avx512":
        flags = frozenset(f for f in flags if not f.startswith(_AVX512_EXTRAS))
    if isa == "generic":
        flags -= {"avx", "avx2", "fma", "f16c", "bf16", "i8mm", "sve", "sve2"}
    return flags


def requested_isa() -> str:
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISAS)}")
    return isa


@functools.cache
def detect() -> CpuInfo:
    isa = requested_isa()
    model, flags = _read_cpuinfo()
    return CpuInfo(platform.machine(), model, _mask(flags, isa), isa)


def isa_env(isa: str | None = None) -> dict[str, str]:
    """ATen's and oneDNN's caps matching `isa` (empty for native): set them before torch
    loads, in the process itself or in a child's environment."""
    isa = isa or requested_isa()
    if isa == "native":
        return {}
    return {"ATEN_CPU_CAPABILITY": _ATEN[isa], "ONEDNN_MAX_CPU_ISA": _ONEDNN[isa]}


def apply_isa_env() -> None:
    """Set the caps for this process (call before torch is imported); explicit values win."""
    for key, value in isa_env().items():
        os.environ.setdefault(key, value)


def engine_key(model: str, dtype: str, quantization: str, threads: int) -> str:
    """What a cost-model fit is valid for: the same model, precision, threads and CPU."""
    info = detect()
    return f"{model}|{dtype}|{quantization}|{threads} threads|{info.model}|{info.level}"


def resolve_dtype(requested: str, device: str = "cpu") -> tuple[str, str]:
    """(dtype, why) for a `--dtype` value: auto becomes bfloat16 or float32 for the device."""
    if requested != "auto":
        return requested, "set explicitly"
    if device.startswith("cuda"):
        return "bfloat16", "auto: CUDA device"
    cpu = detect()
    if cpu.native_bf16:
        native = sorted(cpu.flags & BF16_FLAGS)
        return "bfloat16", f"auto: the CPU computes bf16 natively ({', '.join(native)})"
    return "float32", f"auto: no native bf16 on this CPU ({cpu.level}); bf16 would be emulated"
