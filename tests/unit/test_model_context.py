"""--max-model-len and --rope-scaling: what they admit, what they refuse (naming the
setting), and the config fields they load a model with, checked against transformers'
own RoPE rules."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shared.model_context import model_context, parse_rope_scaling

SMOL = {  # the default model's config.json, as far as the context goes
    "hidden_size": 576,
    "num_attention_heads": 9,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}


def test_as_shipped_the_model_serves_what_it_was_trained_on():
    ctx = model_context(SMOL)
    assert (ctx.max_model_len, ctx.trained_len, ctx.overrides) == (8192, 8192, {})
    assert model_context(SMOL, max_model_len=4096).max_model_len == 4096  # a cap is fine


def test_a_longer_context_needs_rope_scaling_and_says_so():
    with pytest.raises(ValueError, match=r"32768 exceeds the 8192 positions.*yarn:4"):
        model_context(SMOL, max_model_len=32768)
    with pytest.raises(ValueError, match=r"40000 exceeds the 32768 positions.*8192 x 4"):
        model_context(SMOL, max_model_len=40000, rope_scaling="yarn:4")


def test_yarn_x4_serves_32k_and_keeps_the_models_rope_theta():
    ctx = model_context(SMOL, rope_scaling="yarn:4")
    assert ctx.max_model_len == 32768 and ctx.trained_len == 8192
    assert ctx.overrides == {
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_theta": 100000.0,
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    capped = model_context(SMOL, max_model_len=16384, rope_scaling="yarn:4")
    assert capped.max_model_len == 16384
    assert capped.overrides["rope_parameters"]["factor"] == 4.0  # the cap is not the stretch


@pytest.mark.parametrize(
    "text, kind, factor",
    [
        ("yarn:4", "yarn", 4.0),
        (" linear : 2.5 ", "linear", 2.5),
        ('{"rope_type": "llama3", "factor": 8}', "llama3", 8.0),
        ('{"type": "dynamic", "factor": 2}', "dynamic", 2.0),  # transformers' old key
    ],
)
def test_both_spellings_parse(text, kind, factor):
    rope = parse_rope_scaling(text)
    assert rope is not None and (rope.rope_type, rope.factor) == (kind, factor)
    assert parse_rope_scaling("  ") is None


@pytest.mark.parametrize(
    "text, why",
    [
        ("yarn", "TYPE:FACTOR"),
        ("ntk:4", "known types: linear, yarn, llama3, dynamic"),
        ("yarn:0.5", "greater than 1"),
        ("yarn:four", "factor"),
        ('{"rope_type": "yarn", "factor": 4, "betafast": 8}', "betafast"),
        ('{"rope_type": "yarn"', "rope_scaling"),
    ],
)
def test_bad_rope_scaling_is_refused_by_name(text, why):
    with pytest.raises(ValueError, match="rope_scaling") as exc:
        parse_rope_scaling(text)
    assert why in str(exc.value)


def _inv_freq(fields: dict, **kw) -> torch.Tensor:
    cfg = LlamaConfig(**fields)
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":
        base = cfg.rope_parameters["rope_theta"]
        dim = cfg.head_dim
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", **kw)[0]


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3"])
def test_the_overrides_give_transformers_its_own_scaled_rope(kind):
    """transformers builds the scaled frequencies from our fields, and they differ from the
    unscaled ones (the stretch took)."""
    ctx = model_context(SMOL, rope_scaling=f"{kind}:4")
    scaled = _inv_freq({**SMOL, **ctx.overrides})
    plain = _inv_freq(SMOL)
    assert scaled.shape == plain.shape and not torch.allclose(scaled, plain)
    assert torch.all(scaled <= plain * (1 + 1e-6))  # every band slower or unchanged


def test_dynamic_ntk_is_transformers_dynamic_rule_fixed_at_the_longest_context():
    ctx = model_context(SMOL, rope_scaling="dynamic:4")
    assert ctx.overrides["rope_parameters"]["rope_type"] == "default"
    ours = _inv_freq({**SMOL, **ctx.overrides})
    dynamic = {
        **SMOL,
        "rope_parameters": {
            "rope_theta": 100000.0,
            "rope_type": "dynamic",
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    theirs = _inv_freq(dynamic, seq_len=32768)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
