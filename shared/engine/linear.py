"""The engine's linear layers: y = x Wᵀ + b, with the kernel chosen per shape and CPU.

- Dense (fp32 or bf16 weights). A few rows (decode) go through the native GEMV, which
  streams the weights once from a layout packed for it; more rows through torch: oneDNN
  with weights prepacked once for bf16 (the plain call repacks them every time, up to
  half of the matmul at decode sizes), MKL for fp32.
- bf16 where the CPU has AVX512_BF16: the native GEMM (csrc/gemm_bf16.c) instead of both
  the GEMV and oneDNN, at every row count it beats them (see _GEMM_MAX_ROWS).
- Int8 (`--quantization int8`): weights per output channel, symmetric int8; activations
  keep the run's dtype. A quarter of fp32's bytes per decode step (see Int8Linear).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from shared.engine import cpu, kernels

log = logging.getLogger(__name__)
GEMV_BLOCK = 4  # output rows per block in csrc/gemv.c
# Up to this many rows the GEMV beats the library GEMM, by weights and activations, with
# AVX-512 and without (measured on a 2-core Xeon with AMX, and there with the AVX2 cap:
# oneDNN's AMX bf16 caught up at 5-8 rows; MKL fp32 at 32 rows with AVX-512, 16 on AVX2).
_MAX_ROWS_AVX512 = {
    ("dense", torch.bfloat16): 4,
    ("dense", torch.float32): 32,
    ("int8", torch.bfloat16): 6,
    ("int8", torch.float32): 32,
}
_MAX_ROWS_OTHER = {
    ("dense", torch.bfloat16): 4,
    ("dense", torch.float32): 8,
    ("int8", torch.bfloat16): 6,
    ("int8", torch.float32): 16,
}


# Rows up to which the bf16 GEMM beats oneDNN. Without AMX it did at every size measured,
# decode and prefill (AMD EPYC, 2 cores: 1-64 rows at 1.3-2.9x, 512 rows at 0.96-1.3x).
# With AMX, oneDNN's tiles caught up with the GEMV at 5-8 rows, so the GEMM stops there.
_UNBOUNDED = 1 << 20
_GEMM_MAX_ROWS = {"amx": 8, "no_amx": _UNBOUNDED}
GEMM_PANEL = 32  # output columns per panel in csrc/gemm_bf16.c


def gemv_max_rows(kind: str, act_dtype: torch.dtype) -> int:
    table = _MAX_ROWS_AVX512 if "avx512f" in cpu.detect().flags else _MAX_ROWS_OTHER
    return table.get((kind, act_dtype), 0)


QUANTIZATIONS = ("none", "int8")


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """[N, K] → the GEMV's layout: blocks of 4 rows, 64-byte chunks of the 4 rows in turn."""
    n, k = w.shape
    chunk = 64 // w.element_size()
    return (
        w.reshape(n // GEMV_BLOCK, GEMV_BLOCK, k // chunk, chunk).permute(0, 2, 1, 3).contiguous()
    )


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """pack_rows' inverse: the [N, K] row-major weights back."""
    blocks, chunks, rows, chunk = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * rows, chunks * chunk)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] → the GEMM's layout: panels of 32 output columns; in bf16, K in pairs (as
    VDPBF16PS reads them), in fp32 one k at a time."""
    n, k = w.shape
    if w.dtype == torch.float32:
        return w.reshape(n // GEMM_PANEL, GEMM_PANEL, k).permute(0, 2, 1).contiguous()
    return w.reshape(n // GEMM_PANEL, GEMM_PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_panels(packed: torch.Tensor) -> torch.Tensor:
    """pack_panels' inverse: the [N, K] row-major weights back."""
    if packed.dim() == 3:  # fp32
        panels, k, cols = packed.shape
        return packed.permute(0, 2, 1).reshape(panels * cols, k).contiguous()
    panels, pairs, cols, two = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(panels * cols, pairs * two).contiguous()


def gemm_fits(w: torch.Tensor) -> bool:
    """Whether the native GEMM (gemm_bf16.c, gemm_f32.c) takes this weight on this CPU."""
    n, k = w.shape
    if w.device.type != "cpu" or n % GEMM_PANEL != 0 or not kernels.available():
        return False
    if w.dtype == torch.bfloat16:
        return k % 2 == 0 and bool(kernels.lib().gemm_bf16_available())
    return w.dtype == torch.float32 and bool(kernels.lib().gemm_f32_available())


def gemm_max_rows(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return _UNBOUNDED  # it beat MKL at every row count measured (gemm_f32.c)
    return _GEMM_MAX_ROWS["amx" if "amx_bf16" in cpu.detect().flags else "no_amx"]


def gemv_fits(w: torch.Tensor) -> bool:
    n, k = w.shape
    return w.device.type == "cpu" and n % GEMV_BLOCK == 0 and k % 64 == 0 and kernels.available()


class DenseLinear:
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        gemv: bool = True,
        lean: bool = False,
    ) -> None:
        # Detached: a packed copy of a parameter that requires grad would keep the
        # parameter alive through its autograd graph, released or not.
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.bias_f32 = None if self.bias is None else self.bias.float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * weight.element_size()
        # `gemv`: the weights packed for the native kernel, which takes up to `gemv_rows`
        # rows: the GEMM's panels (`gemm`) where the CPU has them, else the GEMV's blocks.
        self.gemm = gemv and gemm_fits(weight)
        self.gemv: torch.Tensor | None = None
        self.gemv_rows = 0
        if self.gemm:
            # `lean`: the GEMM takes every row count, so its panels are the one copy (on
            # a CPU with AMX, long prefill chunks then skip oneDNN's faster tiles).
            self.gemv = pack_panels(weight)
            self.gemv_rows = _UNBOUNDED if lean else gemm_max_rows(weight.dtype)
        elif gemv and gemv_fits(weight):
            self.gemv = pack_rows(weight)
            self.gemv_rows = gemv_max_rows("dense", weight.dtype)
        if self.gemv is not None:
            native = kernels.lib()
            bf16 = weight.dtype == torch.bfloat16
            if self.gemm:
                self._gemv_fn = native.gemm_bf16 if bf16 else native.gemm_f32
            else:
                self._gemv_fn = native.gemv_bf16 if bf16 else native.gemv_f32
            self._gemv_args = (self.gemv.data_ptr(), _ptr(self.bias_f32))
        whole = self.gemv_rows >= _UNBOUNDED  # the native kernel takes every row count
        # oneDNN's copy only where the native kernel leaves rows to it (a third copy of
        # the weights otherwise); the row-major weights only where a library reads them.
        self.packed = None if whole else _onednn_pack(weight)
        self.weight: torch.Tensor | None = None if whole else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        # 0 < rows: a step whose chunks all leave their prompts unfinished asks no logits,
        # and a weight the native kernel does not fit has no kernel to call with none.
        if 0 < rows <= self.gemv_rows and x.dtype == self.dtype:
            x = x.contiguous()
            y = torch.empty(rows, self.out_features, dtype=x.dtype)
            if (
                self._gemv_fn(
                    x.data_ptr(),
                    *self._gemv_args,
                    y.data_ptr(),
                    rows,
                    self.out_features,
                    self.in_features,
                    torch.get_num_threads(),
                )
                == 0
            ):
                return y
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if rows == 0:  # a step whose chunks all leave their prompts unfinished asks no logits
            return x.new_empty(0, self.out_features)
        if self.weight is None:  # the native kernel alone holds the weights
            raise RuntimeError(
                f"native GEMM refused {rows} rows of {x.dtype} for a {self.dtype} linear"
            )
        return F.linear(x, self.weight, self.bias)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout for a bf16 weight, where this CPU and build support it."""
    if (
        w.dtype != torch.bfloat16
        or w.device.type != "cpu"
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    except RuntimeError as exc:  # e.g. "bf16 path needs the cpu support avx_ne_convert or ..."
        global _pack_warned
        if not _pack_warned:
            _pack_warned = True
            log.warning("oneDNN cannot prepack bf16 weights on this CPU (%s); plain linear", exc)
        return None


_pack_warned = False


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [N, K], fp32 scales [N])."""
    w = w.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


class Int8Linear:
    """Weight-only int8. Decode steps (a few rows) are bound by reading weights: those go
    through the int8 GEMV, a quarter of fp32's bytes. More rows are bound by compute, so
    they multiply the same int8 weights dequantized once into the activation dtype (oneDNN
    or MKL); both paths use the int8 grid's values, so the model is one model.

    Activations keep their precision: quantizing them per token too (W8A8) cost 3.5%
    perplexity on this model, more than the 2% the quality gate allows; weights alone
    moved it by under 0.5%."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, lean: bool = False
    ) -> None:
        qweight, self.scales = quantize_weight(weight)
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.gemv = pack_rows(qweight) if gemv_fits(qweight) else None
        self._qweight = qweight if self.gemv is None else None  # else the GEMV's blocks hold it
        self.gemv_rows = gemv_max_rows("int8", weight.dtype) if self.gemv is not None else 0
        self.nbytes = qweight.numel() + self.scales.numel() * 4
        dequantized = (qweight.float() * self.scales[:, None]).to(weight.dtype)
        # More rows: the dequantized weights through the dense path (the native GEMM where
        # there is one; never its GEMV, which this class's own replaces).
        self.dense = DenseLinear(
            dequantized,
            None if bias is None else bias.to(weight.dtype),
            gemv=gemm_fits(dequantized),
            lean=lean,
        )

    @property
    def dequantized(self) -> torch.Tensor:
        """The int8 grid's values in the activation dtype: what both paths multiply by."""
        q = unpack_rows(self.gemv) if self.gemv is not None else self._qweight
        assert q is not None
        return (q.float() * self.scales[:, None]).to(self.dense.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, gemv = x.shape[0], self.gemv
        if gemv is not None and 0 < rows <= self.gemv_rows and x.is_contiguous():
            y = torch.empty(rows, self.out_features, dtype=x.dtype)
            rc = kernels.lib().gemv_i8(
                x.data_ptr(),
                kernels.is_bf16(x),
                gemv.data_ptr(),
                self.scales.data_ptr(),
                _ptr(self.bias_f32),
                y.data_ptr(),
                rows,
                self.out_features,
                self.in_features,
                torch.get_num_threads(),
            )
            if rc == 0:
                return y
        return self.dense(x)


Linear = DenseLinear | Int8Linear


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, lean: bool = False
) -> Linear:
    """`lean`: one copy of the weights where the native kernel takes every row count
    (DenseLinear), at some prefill speed on CPUs with AMX."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r} (expected one of {QUANTIZATIONS})")
    if quantization == "int8":
        if weight.device.type != "cpu":
            raise ValueError("int8 quantization runs on CPU devices only")
        return Int8Linear(weight, bias, lean)
    return DenseLinear(weight, bias, lean=lean)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
