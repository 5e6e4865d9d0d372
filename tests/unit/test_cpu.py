"""CPU dispatch: what the flags and the HALFMOON_CPU_ISA cap make of dtype and kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared.engine import cpu

ZEN5 = frozenset(
    "fma avx f16c avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni".split()
)
EPYC_AVX2 = frozenset("fma avx f16c avx2".split())
SPR = ZEN5 | {"amx_bf16", "amx_tile", "amx_int8", "avx_vnni", "avx512_fp16"}


def info(flags: frozenset[str], isa: str = "native", arch: str = "x86_64") -> cpu.CpuInfo:
    return cpu.CpuInfo(arch, "test cpu", cpu._mask(flags, isa), isa)


def test_native_bf16_only_where_the_cpu_computes_it():
    assert info(ZEN5).native_bf16 and info(SPR).native_bf16
    assert not info(EPYC_AVX2).native_bf16
    assert not info(SPR, "avx2").native_bf16  # the cap hides AMX and AVX-512 BF16
    assert not info(SPR, "avx512").native_bf16  # AVX-512F without its bf16 extension
    assert info(frozenset({"fp", "asimd", "bf16"}), arch="aarch64").native_bf16


def test_levels_and_march_follow_the_cap():
    assert info(SPR).level.startswith("avx512+avx512_bf16")
    assert info(SPR, "avx2").level == "avx2" and info(SPR, "avx2").march() == ["-march=x86-64-v3"]
    assert info(SPR, "generic").level == "x86-64"
    assert info(EPYC_AVX2).level == "avx2" and info(EPYC_AVX2).march() == ["-march=native"]
    assert info(frozenset(), arch="aarch64").march() == ["-mcpu=native"]


def test_auto_dtype_is_bf16_only_with_native_support(monkeypatch):
    for flags, want in ((SPR, "bfloat16"), (ZEN5, "bfloat16"), (EPYC_AVX2, "float32")):
        monkeypatch.setattr(cpu, "detect", lambda flags=flags: info(flags))
        dtype, why = cpu.resolve_dtype("auto")
        assert dtype == want, why
    assert cpu.resolve_dtype("float32") == ("float32", "set explicitly")
    assert cpu.resolve_dtype("auto", "cuda")[0] == "bfloat16"


def test_caps_for_aten_and_onednn():
    assert cpu.isa_env("native") == {}
    assert cpu.isa_env("avx2") == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert cpu.isa_env("generic")["ATEN_CPU_CAPABILITY"] == "default"


def test_unknown_cap_is_refused(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="avx9000"):
        cpu.requested_isa()


def test_the_cap_reaches_aten_before_torch_loads():
    """Importing the engine package sets ATen's cap, so torch dispatches AVX2 kernels."""
    code = (
        "import shared.engine, torch; from shared.engine import cpu; "
        "print(torch.backends.cpu.get_cpu_capability(), cpu.resolve_dtype('auto')[0])"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, cpu.ISA_ENV: "avx2"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[1] == "float32"
    if "avx2" in cpu._read_cpuinfo()[1]:
        assert out[0] == "AVX2"
