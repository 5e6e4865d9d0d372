"""A model's weights as the engine's kernels read them, packed once per model.

Each decoder layer's projections are fused (QKV, gate/up) and packed for the native
kernels (linear.py) the first time any PagedModel over that model asks for them; every
later one (a prefill instance's engine and each pipeline stage it runs, over the same
loaded model) shares the same packed layers instead of packing its own copy. With
`lean`, transformers' copies of a layer's projections are released as soon as the layer
is packed, so that loading peaks near one copy of the model; a layer released once can
only come from this cache after.
"""

from __future__ import annotations

import weakref
from typing import cast

import torch

from shared.engine import architectures
from shared.engine.hf_types import HFDecoderLayer, HFNorm, causal_lm
from shared.engine.linear import Linear, make_linear

_Key = tuple[object, str, bool]  # (layer index or "head", quantization, lean)
_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, dict[_Key, object]] = weakref.WeakKeyDictionary()


class PackedLayer:
    """One decoder layer as the engine runs it: norms, packed projections, q/k norms
    (Qwen3) and its sliding window (0: the whole context)."""

    def __init__(self, layer: HFDecoderLayer, quantization: str, window: int, lean: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm: HFNorm = layer.input_layernorm
        self.post_norm: HFNorm = layer.post_attention_layernorm
        _check_not_released(cast(torch.nn.Module, layer))
        # Fused projections: one GEMM instead of three (and two), same math.
        self.qkv = make_linear(*architectures.qkv_weights(attn), quantization, lean)
        self.o = make_linear(attn.o_proj.weight, attn.o_proj.bias, quantization, lean)
        self.gate_up = make_linear(architectures.gate_up_weight(mlp), None, quantization, lean)
        self.down = make_linear(mlp.down_proj.weight, None, quantization, lean)
        if lean:  # what the engine needs of them it holds now
            architectures.release_projections(cast(torch.nn.Module, layer))
        norms = architectures.qk_norms(attn)
        self.q_norm: HFNorm | None = cast(HFNorm, norms[0]) if norms else None
        self.k_norm: HFNorm | None = cast(HFNorm, norms[1]) if norms else None
        self.window = window

    @property
    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]


def layers(
    hf_model: torch.nn.Module, first: int, end: int, quantization: str, lean: bool
) -> list[PackedLayer]:
    """Layers [first, end) of the model, packed (once per model, quantization and lean)."""
    hf = causal_lm(hf_model)
    cache = _CACHE.setdefault(hf_model, {})
    windows = architectures.layer_windows(hf.config)
    out = []
    for i in range(first, end):
        key: _Key = (i, quantization, lean)
        if key not in cache:
            cache[key] = PackedLayer(hf.model.layers[i], quantization, windows[i], lean)
        out.append(cast(PackedLayer, cache[key]))
    return out


def head(hf_model: torch.nn.Module, quantization: str, lean: bool) -> Linear:
    """The LM head, packed once. It stays in the activation dtype under int8: quantizing
    the final hidden state per token cost about 1.2% perplexity on its own (the layers'
    int8, under 0.1%), more than the 2% budget leaves once bf16 is added."""
    cache = _CACHE.setdefault(hf_model, {})
    key: _Key = ("head", quantization, lean)
    if key not in cache:
        weight = causal_lm(hf_model).lm_head.weight
        cache[key] = make_linear(
            weight, None, "none" if quantization == "int8" else quantization, lean
        )
    return cast(Linear, cache[key])


def _check_not_released(layer: torch.nn.Module) -> None:
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.numel() == 0:
            raise ValueError(
                "this layer's weights were released by a --lean-weights engine with other "
                "settings (quantization or lean); load the model again for these"
            )
