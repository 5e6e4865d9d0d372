"""The model families the engine serves, and the few ways each differs from Llama.

The paged model (model.py) runs one decoder: RMSNorm, a fused QKV projection, RoPE,
attention over the paged pool, O, RMSNorm, a fused gate/up projection, SiLU-mul, down.
The families people deploy on small machines differ from Llama only in small ways, each
a named hook here rather than a copy of the model:

- **Qwen2 / Qwen2.5**: biases on q, k and v (the fused QKV GEMM takes their bias);
  sliding-window attention on some layers where `use_sliding_window` is set.
- **Qwen3** (dense): RMSNorm over each q and k head before RoPE (`qk_norm`), and a
  head_dim that is not hidden / heads (read from the config).
- **Mistral**: sliding-window attention in some versions (v0.1: 4,096 tokens).
- **Phi-3**: q, k, v and gate, up already fused in the checkpoint (`qkv_proj`,
  `gate_up_proj`, laid out as the engine fuses them), and a sliding window.

Anything else is refused at start with one line naming what is served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The supported classes (config.json's `architectures`) and their model_type.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}


class UnsupportedModel(ValueError):
    """A model the engine cannot run: the message says why and what it can run."""


@dataclass(frozen=True)
class Family:
    architecture: str  # the transformers class, e.g. "Qwen3ForCausalLM"
    model_type: str  # config.json's model_type, e.g. "qwen3"


def family(config: Any) -> Family:
    """The family of a transformers config (or config.json as a dict), or UnsupportedModel
    with one line that names the supported ones."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    archs = list(get("architectures", None) or [])
    model_type = str(get("model_type", "") or "")
    for arch in archs:
        if arch in MODEL_TYPES:
            _check_shape(get, arch)
            return Family(arch, MODEL_TYPES[arch])
    if not archs:  # a config built in code names no class: its model_type decides
        for arch, kind in MODEL_TYPES.items():
            if kind == model_type:
                _check_shape(get, arch)
                return Family(arch, kind)
    named = ", ".join(archs) or f"model_type {model_type!r}"
    raise UnsupportedModel(
        f"unsupported model architecture {named}; Halfmoon serves "
        + ", ".join(MODEL_TYPES)
        + " (dense, SiLU MLP, full rotary)"
    )


def check_folder(model_dir: Path) -> Family:
    """The family of a model folder from its config.json alone (before any weights load,
    so an unsupported model costs one line, not a traceback from deep in a loader)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{model_dir}: no readable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise UnsupportedModel(f"{model_dir}: config.json is not a JSON object")
    return family(config)


def _check_shape(get: Any, arch: str) -> None:
    """The variants of a supported class the engine still cannot run, refused by name."""
    act = get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{arch} with hidden_act {act!r}: the engine's MLP is SiLU")
    rope = get("rope_parameters", None) or get("rope_scaling", None) or {}
    partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise UnsupportedModel(
            f"{arch} with partial_rotary_factor {partial}: the engine rotates whole heads"
        )


def layer_windows(config: Any) -> list[int]:
    """Each layer's sliding-window span in tokens, 0 where it attends the whole context:
    `layer_types` decides where the config has them (Qwen2 and Qwen3 slide only some
    layers), else `sliding_window` applies to every layer (Mistral, Phi-3)."""
    n = int(config.num_hidden_layers)
    window = int(getattr(config, "sliding_window", None) or 0)
    types = getattr(config, "layer_types", None)
    if not window:
        return [0] * n
    if types:
        return [window if t == "sliding_attention" else 0 for t in types]
    return [window] * n


def qkv_weights(attn: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[q; k; v] rows of the attention's input projection and their bias (None if
    the projections have none): Phi-3 ships them fused, the others apart."""
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj.weight, attn.qkv_proj.bias
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = torch.cat([p.weight for p in projections])
    biases = [p.bias for p in projections]
    if all(b is None for b in biases):
        return weight, None
    # Only some with a bias (no family does this): the missing ones are zero.
    bias = torch.cat(
        [
            b if b is not None else p.weight.new_zeros(p.out_features)
            for p, b in zip(projections, biases)
        ]
    )
    return weight, bias


def gate_up_weight(mlp: Any) -> torch.Tensor:
    """[gate; up] rows of the MLP's input projection (Phi-3 ships them fused)."""
    if hasattr(mlp, "gate_up_proj"):
        return mlp.gate_up_proj.weight
    return torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))


def qk_norms(attn: Any) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """Qwen3's per-head RMSNorms of q and k (applied before RoPE), or None."""
    q, k = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return (q, k) if q is not None and k is not None else None


def release_projections(layer: torch.nn.Module) -> None:
    """Drops a decoder layer's projection weights (the engine holds its own copies): what
    `--lean-weights` saves. Norms and biases stay; the layer cannot run after."""
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear):
            empty = module.weight.new_empty(0)
            module.weight = torch.nn.Parameter(empty, requires_grad=False)
