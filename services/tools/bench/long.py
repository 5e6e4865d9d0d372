"""`halfmoon bench long`: every long-context figure, each against its old path or its
bound, measured in one run on this machine, and judged against its target.

Parts, in order (--parts picks some):
- attention: prefill attention GFLOP/s of the native paged kernel against SDPA, a
  512-query chunk at the end of a 2k and a 16k context (in process, all allowed cores),
  and which of the two the engine runs here (attention_path.py);
- reuse: TTFT of a 2,048-token prompt whose first 1,792 tokens are cached, against the
  same prompt cold (in process; three rounds, median). Target 0.16x or lower;
- decode: one stream's decode step at a 32k context against its bandwidth bound (the
  weights plus the KV it reads, at the read bandwidth measured in the run). Target 60%;
- handoff: the first-to-second token gap through the live stack at 2k, 8k, 16k and 32k
  tokens, KV streamed while prefill runs against moved after it. Target: the streamed
  gap at 32k within 1.5x of the one at 2k;
- cpp: TTFT of a fresh 8k and 16k prompt on a 2-stage pipelined prefill group, a core
  each, against one instance on one core (and one instance on both). Target 0.6x at 16k.
Each part is its own bench too (bench engine, context, handoff, cpp); this runs them
with the issue's settings and prints one table. Contexts past the trained 8,192
positions use --rope-scaling (yarn:4), on every side of every comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from services.tools.bench import context, cpp, handoff_bench
from services.tools.bench.engine import attention, workloads
from shared.engine import attention_path, cpu
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model
from shared.model_store import ensure_model

PARTS = ("attention", "reuse", "decode", "handoff", "cpp")
HANDOFF_SIZES = "2048,8192,16384,32000"
CPP_SIZES = "8192,16384"
# name -> (how it is read, target, True when lower is better)
TARGETS = {
    "reuse": ("warm / cold TTFT", 0.16, True),
    "decode": ("step bound / step", 0.60, False),
    "handoff": ("streamed gap, 32k / 2k", 1.5, True),
    "cpp": ("group / one instance, 16k", 0.60, True),
}


def _attention(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_model(ensure_model(args.model), args.dtype)
    c = lm.config
    rows = attention.measure(
        c.num_attention_heads,
        c.num_key_value_heads,
        c.hidden_size // c.num_attention_heads,
        lm.dtype,
        chunk=512,
    )
    dtype = str(lm.dtype).removeprefix("torch.")
    return {"dtype": dtype, "rows": rows, "engine_runs": attention_path.describe(lm.dtype)}


def _reuse(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_model(ensure_model(args.model), args.dtype)
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=1 << 30))
    vocab = lm.config.vocab_size
    warm = [random.Random(99).randrange(100, vocab) for _ in range(512)]
    engine.add_request("warm-up", warm, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_work():
        engine.step()
    rounds = [workloads.prefix_reuse(engine, vocab, seed=seed) for seed in range(3)]
    median = statistics.median(r["ratio"] for r in rounds)
    return {"rounds": rounds, "value": median}


def _decode(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--tokens", "32000", "--decode-only", "--dtype", args.dtype, "--rope", args.rope]
    r = context.run(context.parser().parse_args([*flags, *_model(args)]))
    return {**r, "value": r["decode_of_bound"]}


def pool_gb(model_dir: Path, tokens: int, requested: float | None) -> float:
    """Each live engine's KV pool: as asked, or room for the largest prompt twice over in
    fp32 (the widest dtype `auto` picks), in quarter GiB: a 32k prompt of the default
    model is 1.4 GiB of fp32 KV, and decode must hold it whole beside what it reserves."""
    if requested is not None:
        return requested
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4
    return max(1.0, math.ceil(2 * tokens * per_token / 2**30 * 4) / 4)


def _largest(sizes: str) -> int:
    return max(int(x) for x in sizes.split(","))


def _handoff(args: argparse.Namespace) -> dict[str, Any]:
    gb = pool_gb(ensure_model(args.model), _largest(HANDOFF_SIZES), args.kv_cache_gb)
    up = ["--rope-scaling", args.rope, "--kv-cache-gb", str(gb)]
    if args.dtype != "auto":
        up += ["--dtype", args.dtype]
    flags = ["--sizes", HANDOFF_SIZES, "--runs", "1", *(f"--up-flag={f}" for f in up)]
    r = asyncio.run(handoff_bench.run(handoff_bench.parser().parse_args([*flags, *_model(args)])))
    return {**r, "value": r["rows"][-1]["streamed_gap_vs_smallest"]}


def _cpp(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--tokens", CPP_SIZES, "--dtype", args.dtype, "--rope-scaling", args.rope]
    gb = pool_gb(ensure_model(args.model), _largest(CPP_SIZES), args.kv_cache_gb)
    flags += ["--kv-cache-gb", str(gb), *(["--cpus", args.cpus] if args.cpus else [])]
    r = cpp.run(cpp.parser().parse_args([*flags, *_model(args)]))
    one, group, _both = cpp.LAYOUTS
    at = CPP_SIZES.split(",")[-1]
    ratio = statistics.median(r["layouts"][group][at]) / statistics.median(r["layouts"][one][at])
    return {**r, "value": ratio}


def _model(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model] if args.model else []


RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "attention": _attention,
    "reuse": _reuse,
    "decode": _decode,
    "handoff": _handoff,
    "cpp": _cpp,
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each part in turn. A part that fails is recorded as such and the rest still run;
    with --json-out the document is rewritten after every part, so a long run that is
    stopped keeps what it measured."""
    info = cpu.detect()
    out: dict[str, Any] = {
        "machine": f"{info.model}, {len(os.sched_getaffinity(0))} cores, {info.level}",
        "threads": torch.get_num_threads(),
        "parts": {},
    }
    for part in args.parts:
        print(f"bench long: {part} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            out["parts"][part] = RUNNERS[part](args)
        except Exception as e:  # noqa: BLE001 - a part that fails is a result; the rest still run
            print(f"bench long: {part} failed: {e!r}", file=sys.stderr, flush=True)
            out["parts"][part] = {"error": repr(e)}
        out["parts"][part]["part_wall_s"] = round(time.perf_counter() - t0, 1)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
    return out


def verdict(part: str, value: float) -> str:
    _, target, lower = TARGETS[part]
    met = value <= target if lower else value >= target
    return f"{'met' if met else 'NOT MET'} ({'<=' if lower else '>='} {target:g})"


def handoff_excess(rows: list[dict[str, Any]]) -> str:
    """The gap less a later gap of the same stream: what the handoff adds to the decode
    step that any token at that context costs (a step at 32k reads several times the
    KV bytes of one at 2k, handoff or not)."""
    excess = [r["streamed_gap_ms"] - r["streamed_later_gap_ms"] for r in rows]
    per = ", ".join(f"{r['prompt_tokens']}: {e:.1f}" for r, e in zip(rows, excess))
    ratio = excess[-1] / excess[0] if excess[0] > 0 else float("inf")
    return (
        f"streamed gap less a later gap (the handoff's own share), ms: {per} -> "
        f"largest / smallest {ratio:.2f}x"
    )


def render(r: dict[str, Any]) -> str:
    lines = [f"bench long: {r['machine']}", ""]
    failed = {k: v["error"] for k, v in r["parts"].items() if "error" in v}
    p = {k: v for k, v in r["parts"].items() if k not in failed}
    if "attention" in p:
        lines.append(f"prefill attention, {p['attention']['dtype']}, GFLOP/s (512-query chunk):")
        for row in p["attention"]["rows"]:
            native = row.get("native_gflops")
            lines.append(
                f"  {row['context']:>6,}-token context: native {native or 0:6.1f}, SDPA "
                f"{row['sdpa_gflops']:6.1f}"
                + (f" ({row['native_over_sdpa']:.2f}x)" if native else " (no native kernel)")
            )
        lines.append(f"  the engine runs: {p['attention']['engine_runs']}")
    if "reuse" in p:
        rounds = p["reuse"]["rounds"]
        lines.append(
            "prefix reuse, 2,048-token prompt, 1,792 cached: warm "
            f"{statistics.median(x['warm_ttft_ms'] for x in rounds):.0f} ms, cold "
            f"{statistics.median(x['cold_ttft_ms'] for x in rounds):.0f} ms -> "
            f"{p['reuse']['value']:.3f}x  {verdict('reuse', p['reuse']['value'])}"
        )
    if "decode" in p:
        d = p["decode"]
        lines.append(
            f"one-stream decode at {d['tokens']:,} tokens: {d['decode_step_ms']:.1f} ms a step, "
            f"bound {d['decode_bound_ms']:.1f} ms ({d['read_bandwidth_gb_s']:.1f} GB/s) -> "
            f"{d['value']:.0%} of the bound  {verdict('decode', d['value'])}"
        )
    if "handoff" in p:
        lines += ["", p["handoff"]["table"]]
        lines.append(
            f"streamed gap, largest prompt / smallest: {p['handoff']['value']:.2f}x  "
            f"{verdict('handoff', p['handoff']['value'])}"
        )
        lines.append(handoff_excess(p["handoff"]["rows"]))
    if "cpp" in p:
        lines += ["", cpp.render(p["cpp"])]
        lines.append(
            f"16k, group / one instance on one core: {p['cpp']['value']:.2f}x  "
            f"{verdict('cpp', p['cpp']['value'])}"
        )
    lines += [f"{part}: FAILED: {err}" for part, err in failed.items()]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench long",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="model folder (default: the pulled default model)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--rope", default="yarn:4", help="the stretch for contexts past 8,192")
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="each live engine's KV pool (default: twice the largest prompt's fp32 KV)",
    )
    p.add_argument("--cpus", default="", help="cpp's two cores (default: the first two allowed)")
    p.add_argument(
        "--parts",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(PARTS),
        help=f"comma-separated, of {','.join(PARTS)} (default: all)",
    )
    p.add_argument("--json-out", default="", help="also write the JSON document here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if unknown := [x for x in args.parts if x not in PARTS]:
        p.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    result = run(args)
    print(render(result))
    return 1 if any("error" in v for v in result["parts"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
