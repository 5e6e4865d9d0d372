"""`halfmoon bench engine`: the engine at each precision, against transformers and against
this machine's limits, all measured in one run.

For each precision (fp32; bf16 where the CPU computes it natively; int8: weight-only int8,
activations in the run's dtype):
- single stream: a few prompts, one at a time, 128 new tokens each: decode step time
  against its bound (weights + KV at the measured bandwidth, or FLOPs at peak) and
  against transformers `generate` at batch 1 on the same prompts;
- 32 concurrent requests (prompts 64-1,024 tokens, 128 new tokens): decode rate, the
  step time at full batch against its roofline, and transformers `generate` in padded
  batches of 32 on the same prompts.
Then, for the run's default precision: TBT at concurrency 1/8/32/64, prefix reuse, prefill
efficiency and memory; and the int8 quality gate against fp32 (quality.py).
Every system is warmed up the same way before it is timed, on the same threads.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
from dataclasses import replace
from typing import Any, Literal, Sequence

import torch

from services.tools.bench.engine import attention, machine, quality, workloads
from services.tools.bench.engine import baselines as hf
from services.tools.bench.engine.report import render
from services.tools.bench.engine.roofline import ModelShape, decode_step_bound
from shared.engine import cpu, kernels
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.runner import LoadedModel, load_model
from shared.model_store import ensure_model

Quantization = Literal["none", "int8"]
PRECISIONS: dict[str, tuple[str, Quantization]] = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("auto", "int8"),
}


def precisions(arg: str) -> list[str]:
    if arg != "auto":
        names = [p.strip() for p in arg.split(",") if p.strip()]
        unknown = [p for p in names if p not in PRECISIONS]
        if unknown:
            raise SystemExit(f"unknown precision(s) {unknown}; choose from {list(PRECISIONS)}")
        return names
    return ["fp32", *(["bf16"] if cpu.detect().native_bf16 else []), "int8"]


def engine_for(lm: LoadedModel, quantization: Quantization, args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        lm,
        EngineConfig(
            kv_cache_bytes=int(args.kv_cache_gb * 2**30),
            max_num_batched_tokens=args.chunk_tokens,
            max_num_seqs=64,
            quantization=quantization,
        ),
    )


def measure_precision(
    name: str,
    lm: LoadedModel,
    quant: Quantization,
    args: argparse.Namespace,
    limits: machine.Limits,
    work: dict[str, Any],
) -> dict[str, Any]:
    engine = engine_for(lm, quant, args)
    shape = ModelShape.of(lm.model.config)
    kv_item = engine.kv.shape.dtype.itemsize
    weights = engine.model.weight_nbytes
    lin_peak = limits.peak_flops["int8" if quant == "int8" else str(lm.dtype)[6:]]
    attn_peak = limits.peak_flops[str(lm.dtype)[6:]]
    workloads.run(engine, work["warmup"], 8, f"{name}-warm")
    # Shared machines drift: the bandwidth again, right before this precision's runs; the
    # bounds use the best seen (a bound must not be one a noisy moment made easy).
    limits = replace(
        limits, bandwidth_bytes_s=max(limits.bandwidth_bytes_s, machine.read_bandwidth(weights))
    )
    single = workloads.single_stream(engine, work["single"], work["new_tokens"], f"{name}-s")
    single["bound"] = decode_step_bound(
        shape, single["contexts"], weights, kv_item, lin_peak, attn_peak, limits
    )
    batch = workloads.run(engine, work["batch"], work["new_tokens"], f"{name}-b")
    batch["bound"] = decode_step_bound(
        shape, batch["full_step_contexts"], weights, kv_item, lin_peak, attn_peak, limits
    )
    out = {
        "dtype": str(lm.dtype)[6:],
        "quantization": quant,
        "weight_bytes": weights,
        "bandwidth_gb_s": limits.bandwidth_bytes_s / 1e9,
        "single": single,
        "batch": batch,
        "engine": engine,
    }
    return out


def baselines(lm: LoadedModel, work: dict[str, Any]) -> dict[str, Any]:
    hf.generate_batch1(lm, work["warmup"][:1], 8)  # warm-up, as the engine had
    return {
        "batch1": hf.generate_batch1(lm, work["single"], work["new_tokens"]),
        "padded": hf.generate_padded(
            lm, work["batch"], work["new_tokens"], batch=len(work["batch"])
        ),
    }


def default_extras(
    engine: LLMEngine,
    lm: LoadedModel,
    args: argparse.Namespace,
    limits: machine.Limits,
    vocab: int,
    hi: int,
) -> dict[str, Any]:
    shape = ModelShape.of(lm.model.config)
    tbt = {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        r = workloads.run(
            engine, workloads.prompts(c, 64, hi, 100 + c, vocab), 16 if args.quick else 64, f"c{c}-"
        )
        tbt[str(c)] = {k: r[k] for k in ("tbt_p50_ms", "tbt_p99_ms", "decode_tok_s")}
    tokens = 512 if args.quick else 2048
    prefill_s = workloads.prefill(engine, vocab, tokens)
    flops = tokens * shape.linear_flops() + shape.attention_flops(tokens / 2) * tokens
    peak = limits.peak_flops["int8" if engine.config.quantization == "int8" else str(lm.dtype)[6:]]
    return {
        "tbt": tbt,
        "prefix_reuse": workloads.prefix_reuse(engine, vocab),
        "prefill": {
            "tokens": tokens,
            "seconds": prefill_s,
            "gflop_s": flops / prefill_s / 1e9,
            "of_peak": flops / prefill_s / peak,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="halfmoon bench engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="model folder (default: the pulled default model)")
    p.add_argument(
        "--precisions",
        default="auto",
        help="comma list of fp32, bf16, int8 "
        "(auto: fp32, bf16 where the CPU computes it natively, int8)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda (cuda: fp32 and bf16 only)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--quick", action="store_true", help="smaller workload (smoke test)")
    p.add_argument("--skip-baselines", action="store_true", help="no transformers runs")
    p.add_argument("--json-out", default="", help="also write the JSON document here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    names = precisions(args.precisions)
    if args.device == "cuda":
        names = [n for n in names if n != "int8"]
    model_dir = ensure_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_all(names, model_dir, args)
    print(json.dumps(result, indent=2, default=str))
    print(render(result), file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


def run_all(names: list[str], model_dir: Any, args: argparse.Namespace) -> dict[str, Any]:
    auto_dtype = cpu.resolve_dtype("auto", args.device)[0]
    models: dict[str, LoadedModel] = {}

    def model(dtype: str) -> LoadedModel:
        dtype = auto_dtype if dtype == "auto" else dtype
        if dtype not in models:
            models[dtype] = load_model(model_dir, dtype, args.device, args.threads)
        return models[dtype]

    first = model(PRECISIONS[names[0]][0])
    config: Any = first.model.config  # a torch module's attribute, to torch's types
    vocab = min(config.vocab_size, 40_000)
    n, new, hi = (8, 16, 256) if args.quick else (32, 128, 1024)
    work: dict[str, Any] = {
        "warmup": workloads.prompts(2, 64, 128, 99, vocab),
        "new_tokens": new,
        "single": workloads.prompts(2 if args.quick else 4, 128, 512, 3, vocab),
        "batch": workloads.prompts(n, 64, hi, 1, vocab),
    }
    weights_hint = sum(p.numel() * p.element_size() for p in first.model.parameters())
    # every precision's activation dtype (int8's too: its attention runs in it)
    dtypes = sorted({str(model(PRECISIONS[nm][0]).dtype)[6:] for nm in names})
    int8_act = str(model(PRECISIONS["int8"][0]).dtype)[6:] if "int8" in names else None
    limits = machine.measure(weights_hint, dtypes, int8_act, args.device)
    result = header(first.name, args, auto_dtype, limits, len(work["single"]), n, hi, new)
    engines: dict[str, LLMEngine] = {}
    for name in names:
        dtype, quant = PRECISIONS[name]
        lm = model(dtype)
        r = measure_precision(name, lm, quant, args, limits, work)
        engines[name] = r.pop("engine")
        if not args.skip_baselines and quant == "none":
            r["transformers"] = baselines(lm, work)
        result["precisions"][name] = r
    # TBT, prefix reuse and prefill: at the precision `--dtype auto` serves with
    default = default_precision(auto_dtype, names)
    lm = model(PRECISIONS[default][0])
    result["default_precision"] = default
    result.update(default_extras(engines[default], lm, args, limits, vocab, hi))
    if "int8" in engines and "fp32" in engines:
        result["int8_quality"] = quality.gate(
            engines["fp32"], engines["int8"], first.tokenizer, 8 if args.quick else 32
        )
    if args.device == "cpu":  # it times the CPU's kernels; a CUDA run has none to time
        result["prefill_attention"] = prefill_attention(config, dtypes, args.chunk_tokens)
    result["memory"] = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    engines.clear()
    gc.collect()
    return result


def prefill_attention(config: Any, dtypes: list[str], chunk: int) -> dict[str, Any]:
    """The native prefill attention against gather + SDPA, at each float dtype measured."""
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    floats = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    return {
        d: attention.measure(heads, kv_heads, head_dim, floats[d], chunk)
        for d in dtypes
        if d in floats
    }


def header(
    model_name: str,
    args: argparse.Namespace,
    auto_dtype: str,
    limits: machine.Limits,
    single: int,
    batch: int,
    hi: int,
    new: int,
) -> dict[str, Any]:
    """The run's document before any figure: the model, this CPU, its limits, the workload."""
    info = cpu.detect()
    return {
        "model": model_name,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "cpu": {
            "model": info.model,
            "level": info.level,
            "isa_cap": info.isa,
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "kernels": kernels.status(),
        "auto_dtype": auto_dtype,
        "limits": limits.as_dict(),
        "workload": {
            "single_prompts": single,
            "batch_requests": batch,
            "prompt_tokens": f"64-{hi}",
            "new_tokens": new,
        },
        "precisions": {},
    }


def default_precision(auto_dtype: str, names: list[str]) -> str:
    """The precision `--dtype auto` serves with, among those measured."""
    if auto_dtype == "bfloat16" and "bf16" in names:
        return "bf16"
    return "fp32" if "fp32" in names else names[0]
