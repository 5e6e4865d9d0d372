"""A sequence's KV cache as contiguous bytes plus metadata, and back.

Layout: one tensor [layers, 2 (k, v), kv_heads, tokens, head_dim] in the model's dtype,
serialized raw. The metadata names everything a receiver needs to refuse a mismatch
(another model, dtype or layer count) instead of computing garbage.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel
from transformers import DynamicCache

LAYOUT = "layers,kv,heads,tokens,head_dim"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVMeta(BaseModel):
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    block_size: int = 0
    block_hashes: list[int] = []
    layout: str = LAYOUT

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.num_tokens, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.tensor([], dtype=_DTYPES[self.dtype]).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


def export_cache(cache: DynamicCache, model: str, **extra: Any) -> tuple[KVMeta, memoryview]:
    """Batch-1 cache → (meta, bytes). One copy, into the contiguous export tensor."""
    layers = [torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers]
    kv = torch.stack(layers).contiguous().cpu()
    meta = KVMeta(model=model, dtype=dtype_name(kv.dtype), num_layers=kv.shape[0],
                  num_kv_heads=kv.shape[2], num_tokens=kv.shape[3], head_dim=kv.shape[4], **extra)
    return meta, memoryview(kv.view(torch.uint8).numpy()).cast("B")


def import_cache(meta: KVMeta, payload: bytes | bytearray | memoryview, config: Any,
                 device: str = "cpu") -> DynamicCache:
    """bytes → a DynamicCache ready for the next forward step."""
    if meta.layout != LAYOUT:
        raise ValueError(f"unknown KV layout {meta.layout!r}")
    if len(payload) != meta.nbytes:
        raise ValueError(f"KV payload is {len(payload)} bytes, metadata says {meta.nbytes}")
    flat = torch.frombuffer(bytearray(payload) if isinstance(payload, bytes) else payload,
                            dtype=torch.uint8)
    kv = flat.view(_DTYPES[meta.dtype]).reshape(meta.shape).to(device)
    cache = DynamicCache(config=config)
    for i in range(meta.num_layers):
        cache.update(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), i)
    return cache


def check_compatible(meta: KVMeta, model: str, dtype: torch.dtype, num_layers: int) -> None:
    if meta.model != model or meta.dtype != dtype_name(dtype) or meta.num_layers != num_layers:
        raise ValueError(
            f"KV from {meta.model}/{meta.dtype}/{meta.num_layers} layers does not fit "
            f"{model}/{dtype_name(dtype)}/{num_layers} layers")
