"""`halfmoon bench engine`: the engine against transformers on one machine, one run.

Prints one JSON document and a table:
- throughput: 32 concurrent requests (prompts 64-1,024 tokens, 128 new tokens each) through
  the engine, against transformers `generate` at batch 1 and in padded batches of 32 on
  the same requests. "decode" rates count output tokens over the decode phase only;
  "end-to-end" rates include prefill.
- TBT p50/p99 at concurrency 1, 8, 32, 64 (chunked prefill interleaved with decode).
- prefix reuse: TTFT of a 2,048-token prompt whose first 1,792 tokens are cached, vs cold.
- efficiency: achieved GFLOP/s in prefill and in decode at batch 32, next to the peak bf16
  (or the run's dtype) matmul GFLOP/s measured here.
- memory: peak resident memory against KV pool + weights.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from typing import Any, Sequence

import torch

from services.bench import engine_baselines as hf
from services.bench.stats import percentile
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.runner import LoadedModel, load_model
from shared.messages import SamplingParams
from shared.model_store import ensure_model


def workload(n: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str
               ) -> dict[str, Any]:
    """Submit all at once; per-token timestamps give TBT; decode-only steps give the rate."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    stamps: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    decode_s, decode_tokens, decode_steps_32 = 0.0, 0, []
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            stamps.setdefault(out.request_id, []).append(now)
        st = engine.last_step
        if st.num_tokens == st.num_seqs and st.num_seqs:  # a pure decode step
            decode_s += st.seconds
            decode_tokens += st.num_seqs
            if st.num_seqs == 32:
                decode_steps_32.append(st.seconds)
    wall = time.perf_counter() - t0
    gaps = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    total = sum(len(ts) for ts in stamps.values())
    return {"requests": len(prompts), "output_tokens": total, "wall_s": wall,
            "end_to_end_tok_s": total / wall,
            "decode_tok_s": decode_tokens / decode_s if decode_s else float("nan"),
            "tbt_p50_ms": percentile(gaps, 50) * 1e3, "tbt_p99_ms": percentile(gaps, 99) * 1e3,
            "decode_step_b32_ms": percentile(decode_steps_32, 50) * 1e3 if decode_steps_32 else None}


def prefix_reuse(engine: LLMEngine, vocab: int) -> dict[str, float]:
    rng = random.Random(7)
    shared = [rng.randrange(100, vocab) for _ in range(1792)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(rid: str, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, params)
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t0

    tail = lambda: [rng.randrange(100, vocab) for _ in range(256)]  # noqa: E731
    cold = ttft("cold", shared + tail())  # also warms the cache with the shared part
    cold2 = ttft("cold2", [t + 1 for t in shared] + tail())  # nothing cached: a second cold
    warm = ttft("warm", shared + tail())
    return {"cold_ttft_ms": min(cold, cold2) * 1e3, "warm_ttft_ms": warm * 1e3,
            "ratio": warm / min(cold, cold2)}


def flops_per_token(lm: LoadedModel, context: float) -> float:
    """Matmul FLOPs for one token: linear layers + attention over `context` keys + lm_head."""
    cfg = lm.model.config
    d, hd = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    per_layer = qkv + cfg.num_attention_heads * hd * d + 3 * d * cfg.intermediate_size
    attn = 2 * cfg.num_attention_heads * hd * context
    return 2 * cfg.num_hidden_layers * (per_layer + attn)


def efficiency(engine: LLMEngine, lm: LoadedModel, vocab: int, decode_step_ms: float | None,
               mean_ctx: float) -> dict[str, float]:
    rng = random.Random(11)
    prompt = [rng.randrange(100, vocab) for _ in range(2048)]
    engine.add_request("eff", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    prefill_s = time.perf_counter() - t0
    prefill_flops = 2048 * flops_per_token(lm, 1024) + 2 * lm.model.config.hidden_size * \
        lm.model.config.vocab_size
    out = {"prefill_gflops": prefill_flops / prefill_s / 1e9,
           "peak_matmul_gflops": hf.peak_matmul_gflops(lm.dtype, lm.device)}
    if decode_step_ms:
        step_flops = 32 * (flops_per_token(lm, mean_ctx) + 2 * lm.model.config.hidden_size *
                           lm.model.config.vocab_size)
        out["decode_b32_gflops"] = step_flops / (decode_step_ms / 1e3) / 1e9
    return out


def memory(engine: LLMEngine, lm: LoadedModel) -> dict[str, float]:
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss_mib": peak / 2**20, "kv_pool_mib": engine.kv.nbytes / 2**20,
            "weights_mib": weights / 2**20,
            "overhead_mib": (peak - engine.kv.nbytes - weights) / 2**20}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the pulled default model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
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
    lm = load_model(ensure_model(args.model), args.dtype, args.device, args.threads)
    vocab = min(lm.model.config.vocab_size, 40_000)
    cfg = EngineConfig(kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                       max_num_batched_tokens=args.chunk_tokens, max_num_seqs=64)
    engine = LLMEngine(lm, cfg)
    n, new, hi = (8, 32, 256) if args.quick else (32, 128, 1024)
    prompts = workload(n, 64, hi, seed=1, vocab=vocab)
    result: dict[str, Any] = {"model": lm.name, "dtype": args.dtype, "device": args.device,
                              "threads": torch.get_num_threads(), "native_attention": engine.model.native,
                              "workload": {"requests": n, "prompt_tokens": f"64-{hi}", "new_tokens": new}}
    run_engine(engine, workload(2, 64, 128, 99, vocab), 4, "warmup")
    result["engine"] = run_engine(engine, prompts, new, "t")
    result["memory"] = memory(engine, lm)  # before the baselines: ru_maxrss is a high-water mark
    if not args.skip_baselines:
        result["hf_batch1"] = hf.generate_batch1(lm, prompts[: max(2, n // 8)], new)
        result["hf_padded"] = hf.generate_padded(lm, prompts, new, batch=n)
        for k in ("decode_tok_s", "end_to_end_tok_s"):
            result[f"speedup_vs_batch1_{k}"] = result["engine"][k] / result["hf_batch1"][k]
            result[f"speedup_vs_padded_{k}"] = result["engine"][k] / result["hf_padded"][k]
    result["tbt"] = {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        r = run_engine(engine, workload(c, 64, hi, seed=100 + c, vocab=vocab), 64 if not args.quick else 16, f"c{c}-")
        result["tbt"][str(c)] = {k: r[k] for k in ("tbt_p50_ms", "tbt_p99_ms", "decode_tok_s")}
    result["prefix_reuse"] = prefix_reuse(engine, vocab)
    mean_ctx = sum(len(x) for x in prompts) / n + new / 2
    result["efficiency"] = efficiency(engine, lm, vocab, result["engine"]["decode_step_b32_ms"], mean_ctx)
    print(json.dumps(result, indent=2))
    print(render_table(result), file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def render_table(r: dict[str, Any]) -> str:
    e = r["engine"]
    rows = [f"engine bench: {r['model']} {r['dtype']} on {r['device']}, {r['threads']} threads, "
            f"native attention {r['native_attention']}", "",
            f"{'throughput (' + str(r['workload']['requests']) + ' requests)':44}{'decode tok/s':>14}{'e2e tok/s':>12}",
            f"{'halfmoon engine':44}{e['decode_tok_s']:>14.1f}{e['end_to_end_tok_s']:>12.1f}"]
    for key, name in (("hf_batch1", "transformers generate, batch 1"),
                      ("hf_padded", "transformers generate, padded batch")):
        if key in r:
            rows.append(f"{name:44}{r[key]['decode_tok_s']:>14.1f}{r[key]['end_to_end_tok_s']:>12.1f}")
    if "hf_batch1" in r:
        rows.append(f"{'speedup vs batch 1 / vs padded (decode)':44}"
                    f"{r['speedup_vs_batch1_decode_tok_s']:>13.2f}x{r['speedup_vs_padded_decode_tok_s']:>11.2f}x")
    rows += ["", f"{'concurrency':14}{'TBT p50 ms':>12}{'TBT p99 ms':>12}{'decode tok/s':>14}"]
    for c, t in r["tbt"].items():
        rows.append(f"{c:14}{t['tbt_p50_ms']:>12.1f}{t['tbt_p99_ms']:>12.1f}{t['decode_tok_s']:>14.1f}")
    pr, ef, mem = r["prefix_reuse"], r["efficiency"], r["memory"]
    rows += ["", f"prefix reuse: cold TTFT {pr['cold_ttft_ms']:.0f} ms, 1792/2048 cached "
             f"{pr['warm_ttft_ms']:.0f} ms, ratio {pr['ratio']:.3f}",
             f"efficiency: prefill {ef['prefill_gflops']:.0f} GFLOP/s, decode b32 "
             f"{ef.get('decode_b32_gflops', float('nan')):.0f} GFLOP/s, peak matmul "
             f"{ef['peak_matmul_gflops']:.0f} GFLOP/s",
             f"memory: peak RSS {mem['peak_rss_mib']:.0f} MiB = KV pool {mem['kv_pool_mib']:.0f} + "
             f"weights {mem['weights_mib']:.0f} + overhead {mem['overhead_mib']:.0f}"]
    return "\n".join(rows)
