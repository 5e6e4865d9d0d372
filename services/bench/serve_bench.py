"""`halfmoon bench serve`: Halfmoon side by side with `transformers serve` (with and without
its continuous batching), or any OpenAI-compatible URL, on one fixed workload.

Workload: N concurrent streaming chat requests (default 16) whose chat-templated prompts
are ~P tokens (default 256), each producing exactly T tokens (default 64; end of sequence
ignored via `ignore_eos` and transformers' `generation_config.min_new_tokens`), for R
rounds after a warm-up round. `--prompts fixed` sends the same N prompts every round (a
fixed workload: a server with a prefix cache reuses them); `--prompts fresh` makes every
prompt new (no reuse possible). Both are reported by the README's table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from services.bench.client import Result, stream_chat
from services.bench.servers import HalfmoonServer, Server, TransformersServer
from services.bench.stats import percentile
from shared.engine import cpu
from shared.model_store import ensure_model

WORDS = ("moon tide harbor lantern river stone garden winter signal orbit copper meadow "
         "engine archive bridge falcon canyon ember glacier harvest island jungle kettle").split()


def make_prompts(model_dir: Path, n: int, tokens: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"Note {seed}-{i}:"]
        while True:
            text = " ".join(words)
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True)["input_ids"]
            if len(ids) >= tokens:
                break
            words.extend(rng.choice(WORDS) for _ in range(max(1, (tokens - len(ids)) // 2)))
        out.append(text)
    return out


def body(model: str, prompt: str, out_tokens: int, eos_style: str) -> dict[str, Any]:
    """The request; how to ask for exactly `out_tokens` depends on the server: Halfmoon
    and vLLM take `ignore_eos`, transformers serve a `generation_config` (and refuses
    fields it does not know)."""
    b: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                         "max_tokens": out_tokens, "temperature": 0}
    if eos_style == "ignore_eos":
        b["ignore_eos"] = True
    elif eos_style == "generation_config":
        b["generation_config"] = json.dumps({"max_new_tokens": out_tokens,
                                             "min_new_tokens": out_tokens, "do_sample": False})
    return b


async def model_id(http: aiohttp.ClientSession, url: str, fallback: str) -> str:
    try:
        async with http.get(f"{url}/v1/models") as resp:
            data = (await resp.json())["data"]
            return data[0]["id"] if data else fallback
    except (aiohttp.ClientError, KeyError, ValueError):
        return fallback


async def run_rounds(url: str, model_dir: Path, args: argparse.Namespace, concurrency: int,
                     eos_style: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model = await model_id(http, url, str(model_dir))
        results: list[Result] = []
        wall = 0.0
        for rnd in range(args.warmup + args.rounds):
            seed = 0 if args.prompts == "fixed" else rnd + 1
            prompts = make_prompts(model_dir, concurrency, args.prompt_tokens, seed)
            t0 = time.perf_counter()
            batch = await asyncio.gather(*(stream_chat(
                http, url, body(model, p, args.output_tokens, eos_style)) for p in prompts))
            if rnd >= args.warmup:
                wall += time.perf_counter() - t0
                results.extend(batch)
    return summarize(results, wall)


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps_s]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.end_s for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    return {"requests": len(results), "failures": len(results) - len(ok),
            "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall if wall else 0.0,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "e2e_p50_ms": percentile(e2e, 50) * 1e3, "e2e_p99_ms": percentile(e2e, 99) * 1e3,
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "errors": sorted({r.error for r in results if r.error})[:3]}


def servers_for(names: list[str], model_dir: Path, args: argparse.Namespace) -> list[Server]:
    """Every system at the same concrete dtype (transformers' own "auto" means the
    checkpoint's dtype, not this CPU's best)."""
    dtype = cpu.resolve_dtype(args.dtype)[0]
    made: list[Server] = []
    for name in names:
        if name == "halfmoon":
            made.append(HalfmoonServer(model_dir, dtype, args.halfmoon_args.split()))
        elif name in ("transformers", "transformers-cb"):
            made.append(TransformersServer(model_dir, dtype, name.endswith("-cb")))
        else:
            raise SystemExit(f"unknown system {name!r}")
    return made


def measure(server: Server | None, url: str, model_dir: Path, args: argparse.Namespace,
            levels: list[int]) -> dict[str, Any]:
    eos_style = args.eos_style
    if server is not None:
        server.start()
        url = server.url
        eos_style = "ignore_eos" if isinstance(server, HalfmoonServer) else "generation_config"
    try:
        return {str(c): asyncio.run(run_rounds(url, model_dir, args, c, eos_style))
                for c in levels}
    finally:
        if server is not None:
            server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="halfmoon,transformers-cb,transformers",
                   help="servers to start and compare (halfmoon, transformers-cb, transformers)")
    p.add_argument("--url", action="append", default=[], help="also measure this OpenAI-compatible URL")
    p.add_argument("--model", default="", help="model folder (default: the pulled default model)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (auto: bfloat16 where the CPU computes it natively)")
    p.add_argument("--halfmoon-args", default="", help="extra flags for halfmoon up")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sweep", default="", help="concurrency levels, e.g. 1,4,16,64")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", choices=["fixed", "fresh"], default="fixed")
    p.add_argument("--request-timeout-s", type=float, default=600)
    p.add_argument("--eos-style", choices=["ignore_eos", "generation_config", "none"],
                   default="ignore_eos", help="how --url servers are asked to ignore end of sequence")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    model_dir = ensure_model(args.model)
    levels = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.concurrency]
    names = [s for s in args.systems.split(",") if s]
    report: dict[str, Any] = {"workload": {k: getattr(args, k) for k in (
        "prompt_tokens", "output_tokens", "rounds", "warmup", "prompts")},
        "concurrency": levels, "systems": {}}
    report["workload"]["dtype"] = cpu.resolve_dtype(args.dtype)[0]
    for server in servers_for(names, model_dir, args):
        print(f"measuring {server.name} ...", file=sys.stderr, flush=True)
        report["systems"][server.name] = measure(server, "", model_dir, args, levels)
    for url in args.url:
        report["systems"][url] = measure(None, url, model_dir, args, levels)
    print(json.dumps(report, indent=2))
    print(render(report), file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    rows = [f"serving benchmark: {w['prompt_tokens']}+{w['output_tokens']} tokens, "
            f"{w['rounds']} rounds after {w['warmup']} warm-up, prompts {w['prompts']}, {w['dtype']}"]
    base = report["systems"].get("halfmoon")
    for c in report["concurrency"]:
        rows += ["", f"concurrency {c}", f"{'system':26}{'out tok/s':>10}{'TTFT p50':>10}"
                 f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'e2e p50':>9}{'fail':>5}  vs halfmoon"]
        for name, by_c in report["systems"].items():
            r = by_c[str(c)]
            ratio = ""
            if base and name != "halfmoon" and r["output_tok_s"]:
                b = base[str(c)]
                ratio = (f"{b['output_tok_s'] / r['output_tok_s']:.2f}x tok/s, TTFT p50 "
                         f"{b['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x, ITL p99 "
                         f"{b['itl_p99_ms'] / r['itl_p99_ms']:.2f}x")
            rows.append(f"{name:26}{r['output_tok_s']:>10.1f}{r['ttft_p50_ms']:>10.0f}"
                        f"{r['ttft_p99_ms']:>10.0f}{r['itl_p50_ms']:>9.0f}{r['itl_p99_ms']:>9.0f}"
                        f"{r['e2e_p50_ms']:>9.0f}{r['failures']:>5}  {ratio}")
    return "\n".join(rows)
