"""`halfmoon bench context`: what a stretched context costs and brings, on this machine.

The default model was trained on 8,192 positions; `--rope-scaling yarn:4` serves 32,768.
On one long text (default: this Python's standard library sources, files in order, cut
to --tokens) this scores the last --score-tokens three ways, and reports each
perplexity:
- as shipped, seeing the 8,192 tokens before them at most (its trained context);
- stretched, seeing the same window (what the stretch costs at short range);
- stretched, seeing the whole text (what the longer context brings).
Then, on the stretched engine with the whole text in its cache, it times one stream's
decode steps at that context against the step's bandwidth bound: the weights and the
KV a step reads, at the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from services.tools.bench.engine import machine
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.model import PagedModel
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel, load_model
from shared.model_context import for_model
from shared.model_store import ensure_model

TRAINED_WINDOW = 8_192


def long_text(path: str, tokenizer: Any, tokens: int) -> list[int]:
    """Token ids of `path`, or of the standard library's sources in name order, to
    `tokens` (a ValueError if there are not that many)."""
    files = [Path(path)] if path else sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer(f.read_text(errors="replace"))["input_ids"])
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"{path or 'the standard library'} holds {len(ids)} tokens, not {tokens}")


def perplexity(engine: LLMEngine, ids: list[int], scored: int) -> float:
    """exp of the mean negative log-likelihood of the last `scored` tokens of `ids`."""
    logprobs = engine.prompt_logprobs(ids).token_logprobs  # positions 1 .. n-1
    return math.exp(-float(logprobs[-scored:].mean()))


def engine_for(lm: LoadedModel, tokens: int, chunk: int) -> LLMEngine:
    """An engine whose pool holds `tokens` (and a little more) of this model's KV."""
    shape = PagedModel.kv_shape(lm.config, 16, lm.dtype)
    pool = (tokens + 1024) * shape.block_nbytes // shape.block_size
    return LLMEngine(lm, EngineConfig(kv_cache_bytes=pool, max_num_batched_tokens=chunk))


def decode_at(engine: LLMEngine, ids: list[int], steps: int) -> float:
    """Seconds per decode step of one stream after `ids`, best half's mean. The prompt's
    steps (all of it, or only its last token when the prefix cache holds the rest) are
    run first and not timed."""
    engine.add_request(
        "long", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    )
    while not any(o.new_token_ids for o in engine.step()):
        pass  # prefill chunks, up to the first token
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    best = times[: max(1, len(times) // 2)]
    return sum(best) / len(best)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_model(args.model)
    plain = load_model(model_dir, args.dtype, threads=args.threads)
    stretched = load_model(
        model_dir, args.dtype, threads=args.threads, context=for_model(model_dir, 0, args.rope)
    )
    ids = long_text(args.text, plain.tokenizer, args.tokens)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "model": plain.name,
        "dtype": str(plain.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "rope_scaling": args.rope,
        "tokens": len(ids),
    }
    whole = engine_for(stretched, len(ids), args.chunk_tokens)
    if not args.decode_only:
        result.update(perplexities(args, plain, stretched, ids))
        t1 = time.perf_counter()
        result["ppl_stretched_whole"] = perplexity(whole, ids, args.score_tokens)
        result["score_whole_s"] = time.perf_counter() - t1
    step_s = decode_at(whole, ids, args.decode_steps)
    weights = whole.model.weight_nbytes
    kv_read = len(ids) * whole.kv.shape.block_nbytes // whole.kv.shape.block_size
    bandwidth = machine.read_bandwidth(weights + kv_read)
    bound = (weights + kv_read) / bandwidth
    result.update(
        decode_step_ms=step_s * 1e3,
        decode_bound_ms=bound * 1e3,
        decode_of_bound=bound / step_s,
        read_bandwidth_gb_s=bandwidth / 1e9,
        wall_s=time.perf_counter() - t0,
    )
    return result


def perplexities(
    args: argparse.Namespace, plain: LoadedModel, stretched: LoadedModel, ids: list[int]
) -> dict[str, Any]:
    """The last tokens' perplexity in the trained window, as shipped and stretched."""
    window = ids[-min(TRAINED_WINDOW - 1, plain.max_model_len - 1) :]
    short = engine_for(stretched, len(window), args.chunk_tokens)
    return {
        "window": len(window),
        "scored": args.score_tokens,
        "ppl_shipped_window": perplexity(
            engine_for(plain, len(window), args.chunk_tokens), window, args.score_tokens
        ),
        "ppl_stretched_window": perplexity(short, window, args.score_tokens),
    }


def render(r: dict[str, Any]) -> str:
    lines = [
        f"context bench: {r['model']} {r['dtype']}, {r['threads']} threads, "
        f"{r['tokens']:,}-token text"
        + (f", last {r['scored']:,} tokens scored" if "scored" in r else ""),
    ]
    if "ppl_shipped_window" in r:
        lines += [
            f"  perplexity, as shipped, {r['window']:,}-token window:    "
            f"{r['ppl_shipped_window']:.3f}",
            f"  perplexity, {r['rope_scaling']}, the same window:       "
            f"{r['ppl_stretched_window']:.3f}",
            f"  perplexity, {r['rope_scaling']}, all {r['tokens']:,} tokens:  "
            f"{r['ppl_stretched_whole']:.3f} (scored in {r['score_whole_s']:.0f} s)",
        ]
    lines.append(
        f"  one-stream decode at {r['tokens']:,} tokens: {r['decode_step_ms']:.1f} ms a "
        f"step, bound {r['decode_bound_ms']:.1f} ms ({r['decode_of_bound']:.0%} of it; "
        f"read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s, this run)"
    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="halfmoon bench context", description=__doc__)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--rope", default="yarn:4", help="the stretch (--rope-scaling) to measure")
    p.add_argument("--text", default="", help="a long text file (default: the stdlib sources)")
    p.add_argument("--tokens", type=int, default=32_000, help="text length in tokens")
    p.add_argument("--score-tokens", type=int, default=2_000, help="tokens scored at its end")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--decode-only", action="store_true", help="time the decode, skip perplexity")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--json-out", default="")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not 0 < args.score_tokens < TRAINED_WINDOW // 2 or args.tokens <= TRAINED_WINDOW:
        p.error(f"--score-tokens under {TRAINED_WINDOW // 2} and --tokens over {TRAINED_WINDOW}")
    result = run(args)
    print(render(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0
