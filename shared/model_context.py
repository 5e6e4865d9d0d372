"""A model's context length and RoPE scaling, as the operator sets them (config.json in,
config overrides out; no torch, and no file but the config `for_model` reads).

`--rope-scaling yarn:4` stretches a Llama-family model's rotary positions four times, and
`--max-model-len` caps the context the server admits (default: the stretched length). The
engine loads the model with the overrides `context_overrides` returns; the gateway admits
prompts against the same `max_model_len`. One rule, read by both, so they cannot disagree.

Dynamic NTK is served static, as vLLM serves it: the rotary base is fixed at the one the
dynamic rule gives at the longest context. transformers recomputes it from the longest
sequence in each forward pass, but then the keys of a cached block would depend on which
batch computed them, and a prefix cache could not share them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Mapping, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

RopeType = Literal["linear", "yarn", "llama3", "dynamic"]
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)


class RopeScaling(BaseModel):
    """vLLM's and transformers' field names; the defaults are the papers' and Meta's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rope_type: RopeType
    factor: float = Field(gt=1.0, le=1024.0)
    # The positions the model was trained on (default: its config's max_position_embeddings).
    original_max_position_embeddings: int | None = Field(None, gt=0)
    # YaRN (Peng et al. 2023): the rotations that bound the interpolated band.
    beta_fast: float | None = Field(None, gt=0)
    beta_slow: float | None = Field(None, gt=0)
    # Llama 3.1's frequency bands.
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)


def parse_rope_scaling(text: str) -> RopeScaling | None:
    """`yarn:4`, or a JSON object such as `{"rope_type": "yarn", "factor": 4}`; empty: none."""
    text = text.strip()
    if not text:
        return None
    try:
        if text.startswith("{"):
            raw = json.loads(text)
            if isinstance(raw, dict) and "type" in raw and "rope_type" not in raw:
                raw["rope_type"] = raw.pop("type")  # the older transformers spelling
            return RopeScaling.model_validate(raw)
        kind, sep, factor = text.partition(":")
        if not sep:
            raise ValueError(f"expected TYPE:FACTOR or a JSON object, got {text!r}")
        return RopeScaling.model_validate({"rope_type": kind.strip(), "factor": factor.strip()})
    except ValidationError as exc:  # (a ValueError too: caught first)
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    except ValueError as exc:  # bad JSON, or no colon
        why = str(exc)
    raise ValueError(
        f"rope_scaling: {why} (known types: {', '.join(ROPE_TYPES)}; e.g. yarn:4 or "
        f'{{"rope_type": "yarn", "factor": 4}})'
    )


class ModelContext(BaseModel):
    """What the server runs: its context length and the config fields that get it there."""

    model_config = ConfigDict(frozen=True)

    max_model_len: int
    trained_len: int  # the positions the model was trained on
    overrides: dict[str, Any]  # config fields to load the model with ({}: as it ships)


def trained_length(config: Mapping[str, Any]) -> int:
    """The context the config declares, before any scaling of ours."""
    return int(config.get("max_position_embeddings") or 2048)


def _rope_base(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's rope parameters (transformers 5's `rope_parameters`, or the older flat
    `rope_theta`), which scaling keeps, rope_theta above all."""
    params = dict(config.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = float(config.get("rope_theta", 10000.0))
    for key in ("partial_rotary_factor",):
        if key in config and key not in params:
            params[key] = config[key]
    return params


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(
        config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"])
    )


def _rope_parameters(
    config: Mapping[str, Any], rope: RopeScaling, trained: int, max_len: int
) -> dict[str, Any]:
    base = _rope_base(config)
    theta = float(base["rope_theta"])
    original = rope.original_max_position_embeddings or trained
    if rope.rope_type == "dynamic":
        # transformers' dynamic NTK base at a sequence of max_len, fixed (module docstring).
        dim = int(_head_dim(config) * float(base.get("partial_rotary_factor", 1.0)))
        scale = (rope.factor * max_len / original) - (rope.factor - 1)
        theta *= max(scale, 1.0) ** (dim / (dim - 2))
        return {**base, "rope_type": "default", "rope_theta": theta}
    params: dict[str, Any] = {
        **base,
        "rope_type": rope.rope_type,
        "factor": rope.factor,
        "original_max_position_embeddings": original,
    }
    if rope.rope_type == "yarn":
        params.update(
            {k: v for k, v in (("beta_fast", rope.beta_fast), ("beta_slow", rope.beta_slow)) if v}
        )
    if rope.rope_type == "llama3":
        params.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    return params


def model_context(
    config: Mapping[str, Any], max_model_len: int = 0, rope_scaling: str = ""
) -> ModelContext:
    """The context the server runs with, or ValueError naming the setting at fault.

    Without scaling a model serves at most what it was trained on (past it its positions
    are ones it never saw); with scaling, at most the trained length times the factor."""
    trained = trained_length(config)
    rope = parse_rope_scaling(rope_scaling)
    if max_model_len < 0:
        raise ValueError(f"max_model_len must be >= 0, got {max_model_len}")
    if rope is None:
        if max_model_len > trained:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the {trained} positions this model "
                f"was trained on; stretch them with rope_scaling (e.g. yarn:"
                f"{-(-max_model_len // trained)})"
            )
        served = max_model_len or trained
        return ModelContext(max_model_len=served, trained_len=trained, overrides={})
    original = rope.original_max_position_embeddings or trained
    limit = int(original * rope.factor)
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the {limit} positions rope_scaling "
            f"{rope.rope_type} x{rope.factor:g} gives this model ({original} x {rope.factor:g})"
        )
    served = max_model_len or limit
    overrides = {
        "max_position_embeddings": served,
        "rope_parameters": _rope_parameters(config, rope, original, served),
    }
    return ModelContext(max_model_len=served, trained_len=original, overrides=overrides)


def for_model(model_dir: Path, max_model_len: int = 0, rope_scaling: str = "") -> ModelContext:
    """`model_context` for a model folder's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return model_context(config, max_model_len, rope_scaling)
