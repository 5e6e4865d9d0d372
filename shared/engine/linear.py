"""The engine's linear layers: y = x Wᵀ + b, with the kernel chosen per shape and CPU.

- Dense (fp32 or bf16 weights). A few rows (decode) go through the native GEMV, which
  streams the weights once from a layout packed for it; more rows through torch: oneDNN
  with weights prepacked once for bf16 (the plain call repacks them every time, up to
  half of the matmul at decode sizes), MKL for fp32.
- Int8 (`--quantization int8`): weights per output channel, activations per row (token),
  both symmetric int8, int32 accumulation. A row's result depends on that row alone, and
  the integer products are exact, so the GEMV (a few rows) and torch._int_mm (more rows)
  give the same bits whatever the batch. A quarter of fp32's bytes per decode step.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from shared.engine import kernels

log = logging.getLogger(__name__)
GEMV_BLOCK = 4  # output rows per block in csrc/gemv.c
# Up to this many rows the GEMV beats the library GEMM (measured on a 2-core Xeon with
# AMX: oneDNN bf16 caught up at 8 rows, MKL fp32 at 8, _int_mm at 16).
GEMV_MAX_ROWS = {torch.bfloat16: 4, torch.float32: 4, torch.int8: 8}
QUANTIZATIONS = ("none", "int8")


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """[N, K] → the GEMV's layout: blocks of 4 rows, 64-byte chunks of the 4 rows in turn."""
    n, k = w.shape
    chunk = 64 // w.element_size()
    return w.reshape(n // GEMV_BLOCK, GEMV_BLOCK, k // chunk, chunk).permute(0, 2, 1, 3).contiguous()


def gemv_fits(w: torch.Tensor) -> bool:
    n, k = w.shape
    return w.device.type == "cpu" and n % GEMV_BLOCK == 0 and k % 64 == 0 and kernels.available()


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.bias_f32 = None if bias is None else self.bias.float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.gemv = pack_rows(self.weight) if gemv_fits(self.weight) else None
        self.gemv_rows = GEMV_MAX_ROWS.get(self.weight.dtype, 0) if self.gemv is not None else 0
        if self.gemv is not None:
            native = kernels.lib()
            self._gemv_fn = native.gemv_bf16 if weight.dtype == torch.bfloat16 else native.gemv_f32
            self._gemv_args = (self.gemv.data_ptr(), _ptr(self.bias_f32))
        self.packed = _onednn_pack(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.gemv_rows and x.dtype == self.weight.dtype and x.is_contiguous():
            y = torch.empty(rows, self.out_features, dtype=x.dtype)
            if self._gemv_fn(x.data_ptr(), *self._gemv_args, y.data_ptr(), rows, self.out_features,
                             self.in_features, torch.get_num_threads()) == 0:
                return y
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout for a bf16 weight, where this CPU and build support it."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    except RuntimeError as exc:  # e.g. "bf16 path needs the cpu support avx_ne_convert or ..."
        log.warning("oneDNN cannot prepack bf16 weights on this CPU (%s); plain linear", exc)
        return None


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [N, K], fp32 scales [N])."""
    w = w.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.qweight, self.scales = quantize_weight(weight)
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.gemv = pack_rows(self.qweight) if gemv_fits(self.qweight) else None
        self.nbytes = self.qweight.numel() + self.scales.numel() * 4

        self.nbytes = self.qweight.numel() + self.scales.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        x = x.contiguous()
        if not kernels.available():
            return self._torch(x)
        y = torch.empty(rows, self.out_features, dtype=x.dtype)
        q, sx = quantize_rows(x)
        native = kernels.lib()
        if self.gemv is not None and rows <= GEMV_MAX_ROWS[torch.int8]:
            rc = native.gemv_i8(q.data_ptr(), sx.data_ptr(), self.gemv.data_ptr(),
                                self.scales.data_ptr(), _ptr(self.bias_f32), y.data_ptr(),
                                kernels.is_bf16(x), rows, self.out_features, self.in_features,
                                kernels.threads())
            if rc == 0:
                return y
        acc = torch._int_mm(q, self.qweight.t())
        native.dequant_rows(acc.data_ptr(), sx.data_ptr(), self.scales.data_ptr(),
                            _ptr(self.bias_f32), y.data_ptr(), rows, self.out_features,
                            kernels.is_bf16(x), kernels.threads())
        return y

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic without native kernels (no compiler on this machine)."""
        amax = x.float().abs().amax(dim=1)
        sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(x.float() * (1.0 / sx)[:, None]).clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(q, self.qweight.t()) if x.shape[0] > 16 else \
            q.int() @ self.qweight.int().t()
        y = acc.float() * (sx[:, None] * self.scales[None, :])
        if self.bias_f32 is not None:
            y = y + self.bias_f32
        return y.to(x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of a contiguous fp32/bf16 [M, K]: (int8 [M, K], fp32 [M])."""
    rows, dim = x.shape
    q = torch.empty(rows, dim, dtype=torch.int8)
    sx = torch.empty(rows, dtype=torch.float32)
    kernels.lib().quantize_rows(x.data_ptr(), q.data_ptr(), sx.data_ptr(), rows, dim,
                                kernels.is_bf16(x), kernels.threads())
    return q, sx


Linear = DenseLinear | Int8Linear


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str) -> Linear:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r} (expected one of {QUANTIZATIONS})")
    if quantization == "int8":
        if weight.device.type != "cpu":
            raise ValueError("int8 quantization runs on CPU devices only")
        return Int8Linear(weight, bias)
    return DenseLinear(weight, bias)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
