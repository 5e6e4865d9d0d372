"""Native CPU kernels, built on first use with the system C compiler and loaded via ctypes.

Plain C (no torch headers) compiles in a couple of seconds. The sources are built for the
CPU they run on: `-march` comes from `cpu.detect()` (so `HALFMOON_CPU_ISA=avx2` builds the
AVX2 code on an AVX-512 machine), and the C picks its intrinsics from the compiler's
macros. The library is cached under HALFMOON_HOME/kernels by source hash, flags and CPU.
Without a compiler the engine falls back to a pure-torch path (slower, same results);
`available()` says which, and `status()` why.

The library links the OpenMP runtime by soname, so in a process that imported torch it
shares torch's own (the wheel ships libgomp.so.1): one thread pool, no two pools of
spinning threads fighting over the same cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from shared.engine import cpu
from shared.settings import halfmoon_home

log = logging.getLogger(__name__)
SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# No -ffast-math: results must not depend on what the compiler chose to reassociate (it
# once made two kernels round the same formula differently). The reductions vectorize
# through `omp simd reduction` and intrinsics instead; -std=c11 keeps FMA contraction off.
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_status = "not built yet"

# One letter per C type keeps the signature table below readable.
P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float  # noqa: E741
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "paged_decode_attention_bf16": (I, [P, L, I, P, P, P, I, P, I, I, I, I, I, F, I, P, I]),
    "paged_decode_attention_f32": (I, [P, L, I, P, P, P, I, P, I, I, I, I, I, F, I, P, I]),
    "paged_prefill_attention_bf16": (I, [P, L, I, P, P, P, I, I, I, I, I, I, I, F, P, I]),
    "paged_prefill_attention_f32": (I, [P, L, I, P, P, P, I, I, I, I, I, I, I, F, P, I]),
    "rms_norm": (None, [P, P, P, P, I, I, F, I, I]),
    "head_rms_norm": (None, [P, L, I, I, I, I, P, P, F, I, I]),
    "add_inplace": (None, [P, P, L, I, I]),
    "silu_mul": (None, [P, P, I, I, I, I]),
    "rope_kv_write": (None, [P, P, P, P, I, I, I, I, P, P, P, P, I, I, I]),
    "gemv_bf16": (I, [P, P, P, P, I, I, I, I]),
    "gemm_bf16": (I, [P, P, P, P, I, I, I, I]),
    "gemm_bf16_available": (I, []),
    "gemm_f32": (I, [P, P, P, P, I, I, I, I]),
    "gemm_f32_available": (I, []),
    "gemv_f32": (I, [P, P, P, P, I, I, I, I]),
    "gemv_i8": (I, [P, I, P, P, P, P, I, I, I, I]),
    "read_bandwidth_sum": (ctypes.c_double, [P, L, I]),
    "decode_layers": (I, [P, P, P, I, P, P, P, P, I, P, I]),
}


def compile_flags() -> list[str]:
    return [*FLAGS, *cpu.detect().march()]


def _build() -> ctypes.CDLL | None:
    global _status
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if os.environ.get("HALFMOON_NO_NATIVE") == "1":
        _status = "off (HALFMOON_NO_NATIVE=1)"
        return None
    if not cc:
        _status = "no C compiler found"
        return None
    flags = compile_flags()
    info = cpu.detect()
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    # -march=native is only valid on this CPU model, so the CPU is in the key too.
    key = " ".join([cc, *flags, info.model, ",".join(sorted(info.flags))]).encode()
    digest = hashlib.sha256(src + key).hexdigest()[:16]
    out = halfmoon_home() / "kernels" / f"halfmoon-kernels-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            cmd = [cc, *flags, *map(str, SOURCES), "-o", str(tmp_so), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                _status = f"build failed ({' '.join(flags[-1:])}), torch fallback"
                log.warning("native kernel build failed, using torch fallback:\n%s", result.stderr)
                return None
            os.replace(tmp_so, out)  # atomic: concurrent builders never load half a file
    lib = ctypes.CDLL(str(out))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    _status = f"built for {info.level} ({' '.join(cpu.detect().march()) or 'base arch'})"
    return lib


def library() -> ctypes.CDLL | None:
    global _lib, _tried, _status
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except OSError as exc:
                _status = f"unavailable ({exc}), torch fallback"
                log.warning("native kernel unavailable (%s); using torch fallback", exc)
                _lib = None
        return _lib


def available() -> bool:
    return library() is not None


def status() -> str:
    library()
    return _status


def lib() -> ctypes.CDLL:
    native = _lib if _tried else library()  # no lock on the hot path once built
    if native is None:
        raise RuntimeError("native kernels are not available; call available() first")
    return native


def threads() -> int:
    return torch.get_num_threads()


def is_bf16(t: torch.Tensor) -> int:
    if t.dtype == torch.bfloat16:
        return 1
    if t.dtype == torch.float32:
        return 0
    raise ValueError(f"native kernels take fp32 or bf16, not {t.dtype}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """q [S, >=Hq*D] (rows may be wider: q is the head of each qkv row), fp32 or bf16;
    k [blocks, Hkv, D, bs], v [blocks, Hkv, bs, D]; tables [S, max] int32; out [S, Hq*D].
    `window` > 0: each sequence attends only its last `window` tokens (sliding window)."""
    native = lib()
    fn = {
        torch.bfloat16: native.paged_decode_attention_bf16,
        torch.float32: native.paged_decode_attention_f32,
    }[k_cache.dtype]
    num_blocks, hkv, bs, d = v_cache.shape
    assert k_cache.shape == (num_blocks, hkv, d, bs), "k cache is [blocks, heads, dim, block]"
    s = q.shape[0]
    hq = out.shape[1] // d
    assert q.stride(1) == 1 and out.is_contiguous() and out.dtype == q.dtype
    for t in (k_cache, v_cache, block_tables, ctx_lens):
        assert t.is_contiguous() and t.device.type == "cpu"
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        is_bf16(q),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        ctx_lens.data_ptr(),
        s,
        hq,
        hkv,
        d,
        bs,
        scale,
        window,
        out.data_ptr(),
        threads(),
    )
    if rc != 0:
        raise ValueError(
            f"paged attention shape unsupported: heads {hq}/{hkv}, dim {d}, block {bs}"
        )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    pos0: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """A chunk of one sequence's queries, causal, against its KV in place: q [n, >=Hq*D]
    (rows of qkv), query i at position pos0 + i; k [blocks, Hkv, D, bs], v [blocks, Hkv,
    bs, D]; table [>= blocks covering pos0 + n] int32; out [n, Hq*D]. `window` > 0: query
    i sees only keys after pos0 + i - window (sliding window)."""
    native = lib()
    fn = {
        torch.bfloat16: native.paged_prefill_attention_bf16,
        torch.float32: native.paged_prefill_attention_f32,
    }[k_cache.dtype]
    num_blocks, hkv, bs, d = v_cache.shape
    assert k_cache.shape == (num_blocks, hkv, d, bs), "k cache is [blocks, heads, dim, block]"
    n, hq = q.shape[0], out.shape[1] // d
    assert q.stride(1) == 1 and out.is_contiguous() and out.dtype == q.dtype
    assert table.dtype == torch.int32 and table.numel() * bs >= pos0 + n
    for t in (k_cache, v_cache, table):
        assert t.is_contiguous() and t.device.type == "cpu"
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        is_bf16(q),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        n,
        pos0,
        window,
        hq,
        hkv,
        d,
        bs,
        scale,
        out.data_ptr(),
        threads(),
    )
    if rc != 0:
        raise ValueError(
            f"paged prefill attention: shape unsupported (heads {hq}/{hkv}, dim {d}, "
            f"block {bs}) or out of memory ({rc})"
        )
