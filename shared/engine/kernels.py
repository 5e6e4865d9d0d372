"""Native CPU kernels, built on first use with the system C compiler and loaded via ctypes.

Plain C (no torch headers) compiles in about a second. The library is cached under
HALFMOON_HOME/kernels by source hash and compiler flags. Without a compiler the engine
falls back to a pure-torch path (slower, same results); `available()` says which.
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

from shared.settings import halfmoon_home

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
# fast-math lets the compiler vectorize the reductions; finite-math stays off because the
# online softmax starts from -inf.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared",
         "-fPIC", "-std=c11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or os.environ.get("HALFMOON_NO_NATIVE") == "1":
        return None
    src = SOURCE.read_bytes()
    # -march=native: the build is only valid on this CPU model, so the CPU is in the key.
    key = " ".join([cc, *FLAGS, _cpu_flags()]).encode()
    digest = hashlib.sha256(src + key).hexdigest()[:16]
    out = halfmoon_home() / "kernels" / f"paged_attention-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp_so), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("native kernel build failed, using torch fallback:\n%s", result.stderr)
                return None
            os.replace(tmp_so, out)  # atomic: concurrent builders never load half a file
    lib = ctypes.CDLL(str(out))
    for name in ("paged_decode_attention_bf16", "paged_decode_attention_f32"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p] + \
            [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except OSError as exc:
                log.warning("native kernel unavailable (%s); using torch fallback", exc)
                _lib = None
        return _lib


def available() -> bool:
    return library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                           out: torch.Tensor) -> None:
    """q/out [S, Hq, D] fp32; k [blocks, Hkv, D, bs], v [blocks, Hkv, bs, D]; tables [S, max] int32."""
    lib = library()
    assert lib is not None, "call available() first"
    fn = {torch.bfloat16: lib.paged_decode_attention_bf16,
          torch.float32: lib.paged_decode_attention_f32}[k_cache.dtype]
    num_blocks, hkv, bs, d = v_cache.shape
    assert k_cache.shape == (num_blocks, hkv, d, bs), "k cache is [blocks, heads, dim, block]"
    s, hq, _ = q.shape
    for t in (q, k_cache, v_cache, block_tables, ctx_lens, out):
        assert t.is_contiguous() and t.device.type == "cpu"
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], ctx_lens.data_ptr(), s, hq, hkv, d, bs, scale, out.data_ptr(),
            torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged attention shape unsupported: heads {hq}/{hkv}, dim {d}, block {bs}")
