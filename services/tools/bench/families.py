"""`halfmoon bench family`: one stream's decode for each supported family, against its
bandwidth bound, on random weights with the geometry of the family's smallest published
model.

A decode step reads every weight whatever their values, so random weights decode as
fast as trained ones and no download is needed. Per family, in one run and on the same
threads: the machine's read bandwidth (again right before the family, as `bench engine`
does), then a few prompts one at a time; the step's bound is its weights and KV at that
bandwidth (or its FLOPs at the measured matmul peak, where larger). The engines run
with `--lean-weights` (one copy of each weight, transformers' released as they are
packed), so a 7B model in bf16 fits a machine of 24 GiB; past `--max-weights-gb`
(default: 60% of this machine's RAM) a family runs the first layers of its geometry only,
and the report names how many (a step's layers are alike, so the ratio holds).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from services.tools.bench.engine import machine, workloads
from services.tools.bench.engine.roofline import ModelShape, decode_step_bound
from shared.engine import cpu
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.runner import DTYPES, LoadedModel


@dataclass(frozen=True)
class Published:
    model: str  # the smallest published model of the family, whose geometry this is
    config: type[PretrainedConfig]
    fields: dict[str, Any]


# From each model's config.json.
PUBLISHED = {
    "llama": Published(
        "SmolLM2-135M",
        LlamaConfig,
        dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
             tie_word_embeddings=True, max_position_embeddings=8192),
    ),
    "qwen2": Published(
        "Qwen2.5-0.5B",
        Qwen2Config,
        dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
             tie_word_embeddings=True, max_position_embeddings=32768),
    ),
    "qwen3": Published(
        "Qwen3-0.6B",
        Qwen3Config,
        dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
             tie_word_embeddings=True, max_position_embeddings=40960),
    ),
    "mistral": Published(
        "Mistral-7B-v0.1",
        MistralConfig,
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
             sliding_window=4096, max_position_embeddings=32768),
    ),
    "phi3": Published(
        "Phi-3-mini-4k",
        Phi3Config,
        dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
             sliding_window=2047, max_position_embeddings=4096, pad_token_id=0),
    ),
}  # fmt: skip


def layers_within(pub: Published, dtype: torch.dtype, max_bytes: float) -> int:
    """As many of the published layers as keep the weights within `max_bytes`."""
    f = pub.fields
    hd = f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"]
    d, heads, kv = f["hidden_size"], f["num_attention_heads"], f["num_key_value_heads"]
    per_layer = d * (heads + 2 * kv) * hd + heads * hd * d + 3 * d * f["intermediate_size"]
    tables = d * f["vocab_size"] * (1 if f.get("tie_word_embeddings") else 2)
    fit = int((max_bytes / dtype.itemsize - tables) // per_layer)
    return max(1, min(f["num_hidden_layers"], fit))


def random_model(pub: Published, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    """The family's model with random weights, built on the meta device and filled in
    place (transformers' own init walks a 7B model for minutes)."""
    cfg = pub.config(**{**pub.fields, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen).mul_(0.02))
        base: Any = model.model
        base.rotary_emb = type(base.rotary_emb)(config=cfg)  # its buffers were left empty
    model.tie_weights()  # to_empty gave a tied head a storage of its own
    return model.eval()


def measure(family: str, args: argparse.Namespace, peak: dict[str, float]) -> dict[str, Any]:
    pub = PUBLISHED[family]
    dtype_name = cpu.resolve_dtype(args.dtype, "cpu")[0]
    dtype = DTYPES[dtype_name]
    layers = layers_within(pub, dtype, args.max_weights_gb * 2**30)
    model = random_model(pub, layers, dtype)
    lm = LoadedModel(family, model, None, dtype, "cpu", 4096, frozenset())
    cfg = EngineConfig(
        kv_cache_bytes=int(0.5 * 2**30), quantization=args.quantization, lean_weights=True
    )
    engine = LLMEngine(lm, cfg)
    vocab = min(pub.fields["vocab_size"], 30_000)
    workloads.run(engine, workloads.prompts(1, 64, 64, 99, vocab), 8, f"{family}-warm")
    weights = engine.model.weight_nbytes
    # A buffer far past the caches, not the weights' size: beside a 7B model's weights a
    # second copy of them would not fit.
    probe = min(weights, 2 * 2**30)
    limits = machine.Limits(machine.read_bandwidth(probe), peak, torch.get_num_threads())
    single = workloads.single_stream(
        engine, workloads.prompts(3, 128, 512, 3, vocab), args.new_tokens, f"{family}-s"
    )
    shape = ModelShape.of(model.config)
    lin_peak = peak["int8" if args.quantization == "int8" else dtype_name]
    kv_item = engine.kv.shape.dtype.itemsize
    bound = decode_step_bound(
        shape, single["contexts"], weights, kv_item, lin_peak, peak[dtype_name], limits
    )
    step = single["step_p50_ms"] / 1e3
    out = {
        "published": pub.model,
        "architecture": engine.model.family.architecture,
        "layers": f"{layers}/{pub.fields['num_hidden_layers']}",
        "dtype": dtype_name,
        "quantization": args.quantization,
        "weights_gb": weights / 1e9,
        "bandwidth_gb_s": limits.bandwidth_bytes_s / 1e9,
        "native_decode_step": type(engine.model._step).__name__ == "NativeDecodeStep",
        "step_p50_ms": single["step_p50_ms"],
        "bound_ms": bound["bound_s"] * 1e3,
        "of_bound": bound["bound_s"] / step,
        "decode_tok_s": single["decode_tok_s"],
        "stream_gb_s": bound["bytes"] / step / 1e9,
    }
    del engine, lm, model
    gc.collect()
    return out


def render(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "family   geometry of        layers  dtype     weights  step p50  bound    of bound  tok/s",
    ]
    for fam, r in rows.items():
        dt = r["dtype"] + ("+int8" if r["quantization"] == "int8" else "")
        lines.append(
            f"{fam:<8} {r['published']:<18} {r['layers']:<7} {dt:<9} {r['weights_gb']:5.2f} GB"
            f"  {r['step_p50_ms']:6.1f} ms {r['bound_ms']:6.1f} ms {r['of_bound']:7.0%}"
            f"  {r['decode_tok_s']:6.1f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="halfmoon bench family",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--families", default=",".join(PUBLISHED), help="comma list")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--quantization", default="none", choices=("none", "int8"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--max-weights-gb", type=float, default=0.0, help="0: 60%% of this machine's RAM"
    )
    args = p.parse_args(argv)
    if not args.max_weights_gb:
        args.max_weights_gb = 0.6 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in PUBLISHED]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {', '.join(PUBLISHED)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = cpu.resolve_dtype(args.dtype, "cpu")[0]
    peak = machine.peaks([dtype_name], dtype_name if args.quantization == "int8" else None)
    rows = {f: measure(f, args, peak) for f in families}
    result = {"cpu": cpu.detect().model, "threads": torch.get_num_threads(), "families": rows}
    print(json.dumps(result, indent=2))
    print(render(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
