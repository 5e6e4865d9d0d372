"""`halfmoon bench spec`: what prompt-lookup speculative decoding gains on answers that
quote their prompt, and what it costs on fresh chat, one stream, in process.

Two engines on the same loaded model and threads, one with --num-speculative-tokens
drafts and one without, take turns on each prompt (greedy, the same output cap). Each
prompt's decode rate is its output tokens after the first over the time from the first
token to the last: speculation changes decode, not the prompt. In fp32 both engines must
give the same tokens (greedy speculation is exact) or the run fails. In bf16 a draft's
verification rows take the kernels of a decode batch of k + 1 rows, whose rounding can
differ from one row's (as a sequence's output can differ with its batch), so the run
counts the outputs that came out identical.

Workloads, as chat requests through the model's template:
- grounded: answers that copy from the prompt: repeat a function of this Python's
  standard library, or rename a name in it and give the function back;
- fresh: chat prompts of random words (bench serve's fresh prompts), where drafts
  rarely find anything to copy.
Targets (issue 30): grounded 1.5x or more; fresh at most 5% slower (0.95x).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from services.tools.bench.grounded import grounded_prompts
from services.tools.bench.serve.workload import WORDS
from shared.engine import cpu
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model
from shared.engine.speculative import SpeculativeConfig
from shared.model_store import ensure_model

TARGETS = {"grounded": (1.5, False), "fresh": (0.95, False)}  # (target, lower is better)


def fresh_prompts(n: int, seed: int = 30) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
        for _ in range(n)
    ]


def decode(engine: LLMEngine, rid: str, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """The output tokens and the seconds from the first token to the last."""
    engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    tokens: list[int] = []
    first = 0.0
    while engine.has_work():
        for out in engine.step():
            if not tokens and out.new_token_ids:
                first = time.perf_counter()
            tokens.extend(out.new_token_ids)
    return tokens, time.perf_counter() - first


def run(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_model(ensure_model(args.model), args.dtype)
    assert lm.tokenizer is not None
    pool = 256 << 20
    plain = LLMEngine(lm, EngineConfig(kv_cache_bytes=pool))
    spec = SpeculativeConfig(args.num_speculative_tokens, args.lookup_min, args.lookup_max)
    drafted = LLMEngine(lm, EngineConfig(kv_cache_bytes=pool, speculative=spec))
    workloads = {"grounded": grounded_prompts(), "fresh": fresh_prompts(args.fresh)}
    for engine in (plain, drafted):  # warm-up: first touches, kernel builds
        decode(engine, "warm", _ids(lm, fresh_prompts(1, seed=1)[0]), 16)
    info = cpu.detect()
    out: dict[str, Any] = {
        "machine": f"{info.model}, {info.level}",
        "dtype": str(lm.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "num_speculative_tokens": args.num_speculative_tokens,
        "workloads": {},
    }
    for name, prompts in workloads.items():
        rows = []
        for i, messages in enumerate(prompts):
            ids = _ids(lm, list(messages))
            before = drafted.stats()
            want, t_plain = decode(plain, f"{name}{i}", ids, args.max_tokens)
            got, t_spec = decode(drafted, f"{name}{i}", ids, args.max_tokens)
            after = drafted.stats()
            same = _common_prefix(got, want)
            if got != want and lm.dtype == torch.float32:
                raise RuntimeError(f"{name} prompt {i}: drafted output differs from plain")
            n = len(want) - 1
            rows.append(
                {
                    "prompt_tokens": len(ids),
                    "output_tokens": len(want),
                    "plain_tok_s": n / t_plain if n > 0 else 0.0,
                    "spec_tok_s": n / t_spec if n > 0 else 0.0,
                    "drafted": after.spec_draft_tokens - before.spec_draft_tokens,
                    "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens,
                    "same_tokens": same,
                    "spec_output_tokens": len(got),
                }
            )
            print(f"bench spec: {name} {i}: {rows[-1]}", file=sys.stderr, flush=True)
        out["workloads"][name] = summarize(rows)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rates over the whole workload (tokens over seconds, summed), not a mean of rates;
    each engine's rate over its own output (in bf16 the two may part ways)."""
    tokens = sum(r["output_tokens"] - 1 for r in rows)
    spec_tokens = sum(r["spec_output_tokens"] - 1 for r in rows)
    plain_s = sum((r["output_tokens"] - 1) / r["plain_tok_s"] for r in rows if r["plain_tok_s"])
    spec_s = sum((r["spec_output_tokens"] - 1) / r["spec_tok_s"] for r in rows if r["spec_tok_s"])
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    return {
        "rows": rows,
        "plain_tok_s": tokens / plain_s,
        "spec_tok_s": spec_tokens / spec_s,
        "ratio": (spec_tokens / spec_s) / (tokens / plain_s),
        "acceptance": accepted / drafted if drafted else 0.0,
        "accepted_per_token": accepted / spec_tokens if spec_tokens else 0.0,
        "identical": sum(
            r["same_tokens"] == r["output_tokens"] == r["spec_output_tokens"] for r in rows
        ),
    }


def _ids(lm: Any, messages: list[dict[str, str]]) -> list[int]:
    encoded: Any = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(encoded["input_ids"])


def render(r: dict[str, Any]) -> str:
    lines = [
        f"bench spec: {r['machine']}, {r['dtype']}, {r['threads']} threads, one stream, "
        f"greedy, up to {r['num_speculative_tokens']} drafts a step",
        f"{'workload':>9} {'prompts':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
        f"{'accepted':>8} {'kept/token':>10}  verdict",
    ]
    for name, w in r["workloads"].items():
        target, _ = TARGETS[name]
        met = w["ratio"] >= target
        lines.append(
            f"{name:>9} {len(w['rows']):>7} {w['plain_tok_s']:>11.1f} {w['spec_tok_s']:>10.1f} "
            f"{w['ratio']:>5.2f}x {w['acceptance']:>8.0%} {w['accepted_per_token']:>10.2f}  "
            f"{'met' if met else 'NOT MET'} (>= {target:g}x); "
            f"{w['identical']} of {len(w['rows'])} outputs identical"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="model folder (default: the pulled default model)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160, help="output tokens per prompt at most")
    p.add_argument("--fresh", type=int, default=6, help="fresh chat prompts")
    p.add_argument("--json-out", default="", help="also write the JSON document here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = run(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
