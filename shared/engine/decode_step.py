"""The whole layer stack of a small decode step in one native call (csrc/decode_step.c).

Describes the model to C once (every layer's packed weights, norms and KV pool, as
pointers into tensors this object keeps alive), then each step passes only what changes:
the hidden rows, their positions and KV slots, the block tables.
"""

from __future__ import annotations

import ctypes
from typing import Protocol, Sequence

import torch

from shared.engine import kernels
from shared.engine.batch import BatchMeta
from shared.engine.hf_types import HFConfig, HFNorm
from shared.engine.kv_cache import KVCache
from shared.engine.linear import DenseLinear, Int8Linear, Linear

P = ctypes.c_void_p


class StepLayer(Protocol):
    """What the native step reads of a layer of the paged model (model.py)."""

    @property
    def input_norm(self) -> HFNorm: ...
    @property
    def post_norm(self) -> HFNorm: ...
    @property
    def qkv(self) -> Linear: ...
    @property
    def o(self) -> Linear: ...
    @property
    def gate_up(self) -> Linear: ...
    @property
    def down(self) -> Linear: ...
    @property
    def linears(self) -> list[Linear]: ...

    q_norm: HFNorm | None
    k_norm: HFNorm | None
    window: int


class StepModel(Protocol):
    """What the native step reads of the paged model (model.py's PagedModel)."""

    @property
    def layers(self) -> Sequence[StepLayer]: ...
    @property
    def kv(self) -> KVCache: ...
    @property
    def config(self) -> HFConfig: ...
    @property
    def native(self) -> bool: ...
    @property
    def dtype(self) -> torch.dtype: ...

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", P),
        ("scales", P),
        ("bias", P),
        ("out_features", ctypes.c_int),
        ("in_features", ctypes.c_int),
        ("gemm", ctypes.c_int),
        ("dense", P),
        ("dense_bias", P),
        ("i8_rows", ctypes.c_int),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", P),
        ("post_norm", P),
        ("q_norm", P),
        ("k_norm", P),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", P),
        ("v_cache", P),
        ("window", ctypes.c_int),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("num_q_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("act_bf16", ctypes.c_int),
        ("kv_bf16", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", P),
        ("sin", P),
        ("layers", ctypes.POINTER(_Layer)),
    ]


def _linear(lin: Linear) -> _Linear:
    assert lin.gemv is not None
    bias = lin.bias_f32.data_ptr() if lin.bias_f32 is not None else None
    if isinstance(lin, DenseLinear):
        return _Linear(
            lin.gemv.data_ptr(), None, bias, lin.out_features, lin.in_features, int(lin.gemm)
        )
    dense = _gemm_panels(lin)
    return _Linear(
        lin.gemv.data_ptr(),
        lin.scales.data_ptr(),
        bias,
        lin.out_features,
        lin.in_features,
        0,
        dense.gemv.data_ptr() if dense is not None and dense.gemv is not None else None,
        dense.bias_f32.data_ptr() if dense is not None and dense.bias_f32 is not None else None,
        lin.gemv_rows,
    )


def _gemm_panels(lin: Int8Linear) -> DenseLinear | None:
    """An int8 layer's dequantized weights, where they are in the GEMM's panels."""
    return lin.dense if lin.dense.gemm else None


def native_rows(lin: Linear) -> int:
    """Rows a linear takes through the native kernels: an int8 layer's GEMV, then (where
    its dequantized weights are the GEMM's panels) the GEMM, as Int8Linear.__call__ does."""
    if isinstance(lin, Int8Linear) and (dense := _gemm_panels(lin)) is not None:
        return max(lin.gemv_rows, dense.gemv_rows)
    return lin.gemv_rows


class NativeDecodeStep:
    def __init__(self, model: StepModel, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._fn = kernels.lib().decode_layers
        self._keep = (cos, sin)  # the tables must outlive every call
        # As many rows as every linear takes through its native kernel (the same for all).
        self.max_rows = min(native_rows(lin) for layer in model.layers for lin in layer.linears)
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            layers[i] = _Layer(
                layer.input_norm.weight.data_ptr(),
                layer.post_norm.weight.data_ptr(),
                layer.q_norm.weight.data_ptr() if layer.q_norm is not None else None,
                layer.k_norm.weight.data_ptr() if layer.k_norm is not None else None,
                _linear(layer.qkv),
                _linear(layer.o),
                _linear(layer.gate_up),
                _linear(layer.down),
                model.kv.k[i].data_ptr(),
                model.kv.v[i].data_ptr(),
                layer.window,
            )
        self._layers = layers
        cfg = model.config
        self._model = _Model(
            len(model.layers),
            cfg.hidden_size,
            cfg.intermediate_size,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            model.kv.shape.block_size,
            int(model.dtype == torch.bfloat16),
            int(model.kv.shape.dtype == torch.bfloat16),
            model.eps,
            model.scale,
            cos.data_ptr(),
            sin.data_ptr(),
            layers,
        )

    @staticmethod
    def supports(model: StepModel) -> bool:
        linears = [lin for layer in model.layers for lin in layer.linears]
        return (
            model.native
            and all(lin.gemv is not None for lin in linears)
            and len({type(lin) for lin in linears}) == 1
            and all(isinstance(lin, (DenseLinear, Int8Linear)) for lin in linears)
        )

    def fits(self, meta: BatchMeta) -> bool:
        n = meta.input_ids.shape[0]
        return not meta.chunks and meta.num_single == n and n <= self.max_rows

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        """Runs every layer on h in place; returns the last layer's MLP output (to add)."""
        delta = torch.empty_like(h)
        rc = self._fn(
            ctypes.addressof(self._model),
            h.data_ptr(),
            delta.data_ptr(),
            h.shape[0],
            positions.data_ptr(),
            meta.slot_blocks.data_ptr(),
            meta.slot_offsets.data_ptr(),
            meta.single_tables.data_ptr(),
            meta.single_tables.shape[1],
            meta.single_ctx.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"native decode step failed ({rc})")
        return delta
