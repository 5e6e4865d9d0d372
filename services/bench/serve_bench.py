"""`halfmoon bench serve`: Halfmoon side by side with `transformers serve` (with and without
its continuous batching), or any OpenAI-compatible URL, on one workload.

Workload: N concurrent streaming chat requests (default 16) whose chat-templated prompts
are ~P tokens (default 256), each producing exactly T tokens (default 64; end of sequence
ignored via `ignore_eos` and transformers' `generation_config.min_new_tokens`), for R
rounds after a warm-up round, at each concurrency level.

Prompts: `--prompts fresh` (the default) gives every round, the warm-up included, prompts
never sent before, to every system: each starts with its own system message, so no two
share even their first KV block and no prefix cache can serve any of them. `--prompts
fixed` ("cache-friendly") sends the same N prompts every round, the warm-up included, so
a server with a prefix cache serves the repeats from it.

Fairness: every system started here runs on the same CPUs (`--cpus`, default all this
process may use; the whole process tree is pinned), with the same compute threads in
total, the same concrete dtype, the same warm-up and the same prompts. A banner (also in
the JSON, under "setup") says what ran where, read back from /proc after the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from services.bench.client import Result, stream_chat
from services.bench.servers import (
    HalfmoonServer,
    Placement,
    Server,
    TransformersServer,
    format_cpus,
    parse_cpus,
    placements,
)
from services.bench.stats import percentile
from shared.engine import cpu
from shared.model_store import ensure_model

WORDS = (
    "moon tide harbor lantern river stone garden winter signal orbit copper meadow "
    "engine archive bridge falcon canyon ember glacier harvest island jungle kettle"
).split()
PROMPT_LABELS = {"fresh": "fresh", "fixed": "cache-friendly"}
Messages = list[dict[str, str]]


# --- prompts ----------------------------------------------------------------------------


def prompt_tag(mode: str, seed: str, concurrency: int, rnd: int) -> str:
    """What makes a round's prompts its own: under fresh, the run's seed, the level and
    the round (warm-up included); under fixed, only the seed."""
    return f"{seed}-fixed" if mode == "fixed" else f"{seed}-c{concurrency}-r{rnd}"


def unique_lead(key: str) -> str:
    """A system message that makes a prompt its own from its first tokens on: a digest of
    the key comes right after the template's "<|im_start|>system" (the key itself would
    put what differs, say the round, past the first KV block), and it replaces the
    template's default system prompt, which every prompt would share as its first block."""
    return f"{hashlib.sha256(key.encode()).hexdigest()[:12]} session {key}."


class PromptMaker:
    """Chat prompts of at least `tokens` tokens once the chat template is applied."""

    def __init__(self, model_dir: Path, tokens: int) -> None:
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.tokens = tokens
        self._made: dict[str, list[Messages]] = {}

    def ids(self, messages: Messages) -> list[int]:
        return self.tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]

    def one(self, tag: str, i: int) -> Messages:
        system = {"role": "system", "content": unique_lead(f"{tag}-{i}")}
        rng = random.Random(f"{tag}-{i}")
        words: list[str] = []
        while True:
            messages = [system, {"role": "user", "content": " ".join(words)}]
            short = self.tokens - len(self.ids(messages))
            if short <= 0:
                return messages
            words.extend(rng.choice(WORDS) for _ in range(max(1, short // 2)))

    def round(self, tag: str, n: int) -> list[Messages]:
        """n prompts for one round; a fixed tag gives the same prompts every time."""
        made = self._made.setdefault(tag, [])
        made.extend(self.one(tag, i) for i in range(len(made), n))
        return made[:n]


# --- one system -------------------------------------------------------------------------


def body(model: str, messages: Messages, out_tokens: int, eos_style: str) -> dict[str, Any]:
    """The request; how to ask for exactly `out_tokens` depends on the server: Halfmoon
    and vLLM take `ignore_eos`, transformers serve a `generation_config` (and refuses
    fields it does not know)."""
    b: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": out_tokens,
        "temperature": 0,
    }
    if eos_style == "ignore_eos":
        b["ignore_eos"] = True
    elif eos_style == "generation_config":
        b["generation_config"] = json.dumps(
            {"max_new_tokens": out_tokens, "min_new_tokens": out_tokens, "do_sample": False}
        )
    return b


async def model_id(http: aiohttp.ClientSession, url: str, fallback: str) -> str:
    try:
        async with http.get(f"{url}/v1/models") as resp:
            data = (await resp.json())["data"]
            return data[0]["id"] if data else fallback
    except (aiohttp.ClientError, KeyError, ValueError):
        return fallback


async def run_rounds(
    url: str, maker: PromptMaker, args: argparse.Namespace, concurrency: int, eos_style: str
) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model = await model_id(http, url, str(maker.model_dir))
        results: list[Result] = []
        wall = 0.0
        for rnd in range(args.warmup + args.rounds):
            tag = prompt_tag(args.prompts, args.prompt_seed, concurrency, rnd)
            prompts = maker.round(tag, concurrency)
            t0 = time.perf_counter()
            batch = await asyncio.gather(
                *(
                    stream_chat(http, url, body(model, p, args.output_tokens, eos_style))
                    for p in prompts
                )
            )
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
    return {
        "requests": len(results),
        "failures": len(results) - len(ok),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall if wall else 0.0,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "e2e_p50_ms": percentile(e2e, 50) * 1e3,
        "e2e_p99_ms": percentile(e2e, 99) * 1e3,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
    }


def servers_for(names: list[str], model_dir: Path, args: argparse.Namespace) -> list[Server]:
    """Every system at the same concrete dtype (transformers' own "auto" means the
    checkpoint's dtype, not this CPU's best), on the same CPUs and threads in total."""
    dtype = cpu.resolve_dtype(args.dtype)[0]
    extra = args.halfmoon_args.split()
    halfmoon, transformers = placements(parse_cpus(args.cpus), extra)
    made: list[Server] = []
    for name in names:
        if name == "halfmoon":
            made.append(HalfmoonServer(model_dir, dtype, halfmoon, extra))
        elif name in ("transformers", "transformers-cb"):
            made.append(TransformersServer(model_dir, dtype, transformers, name.endswith("-cb")))
        else:
            raise SystemExit(f"unknown system {name!r}")
    return made


def measure(
    server: Server | None, url: str, maker: PromptMaker, args: argparse.Namespace, levels: list[int]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """({concurrency: summary}, the server's processes as seen after the runs)."""
    eos_style = args.eos_style
    try:
        if server is not None:  # inside the try: a server that dies starting is cleaned up too
            server.start()
            url = server.url
            eos_style = "ignore_eos" if isinstance(server, HalfmoonServer) else "generation_config"
        by_level = {str(c): asyncio.run(run_rounds(url, maker, args, c, eos_style)) for c in levels}
        return by_level, server.observe() if server is not None else []
    finally:
        if server is not None:
            server.stop()


# --- what ran where ---------------------------------------------------------------------


def system_setup(server: Server) -> dict[str, Any]:
    p: Placement = server.placement
    return {
        "placement": p.as_dict(),
        "env": p.env(),
        "command": server.command(),
        "prefix_cache": server.prefix_cache,
        "reports_cached_tokens": server.reports_cached_tokens,
    }


def setup_for(args: argparse.Namespace, servers: list[Server]) -> dict[str, Any]:
    dtype, why = cpu.resolve_dtype(args.dtype)
    cpus = parse_cpus(args.cpus)
    systems = {s.name: system_setup(s) for s in servers}
    systems.update(
        {url: {"placement": None, "prefix_cache": "unknown (external)"} for url in args.url}
    )
    return {
        "cpus": format_cpus(cpus),
        "cpu_count": len(cpus),
        "machine_cpus": os.cpu_count(),
        "dtype": dtype,
        "dtype_why": why,
        "prompts": args.prompts,
        "prompts_label": PROMPT_LABELS[args.prompts],
        "prompt_seed": args.prompt_seed,
        "client": {"pid": os.getpid(), "cpus": format_cpus(sorted(os.sched_getaffinity(0)))},
        "systems": systems,
    }


def _prompts_line(setup: dict[str, Any]) -> str:
    if setup["prompts"] == "fresh":
        return (
            "fresh: every round and the warm-up send prompts never sent before "
            f"(seed {setup['prompt_seed']}); no prefix cache can serve them"
        )
    return (
        "fixed (cache-friendly): the same prompts every round, warm-up included, so a "
        "prefix cache serves the repeats"
    )


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def _system_line(name: str, s: dict[str, Any]) -> str:
    p = s["placement"]
    if p is None:
        return f"  {name:24} external: not started nor pinned here; prefix cache unknown"
    unit = "engine" if name == "halfmoon" else "process"
    return (
        f"  {name:24} {_count(p['processes'], unit)} x {_count(p['threads'], 'thread')} "
        f"({p['total_threads']} in total, OMP_NUM_THREADS={s['env']['OMP_NUM_THREADS']}) "
        f"on cpus {p['cpus']}; prefix cache: {s['prefix_cache']}"
    )


def _observed_line(name: str, s: dict[str, Any]) -> str:
    seen = s.get("observed") or []
    want = s["placement"]["cpus"]
    off = [p for p in seen if p["cpus"] != want]
    procs = ", ".join(f"{p['name']} ({p['os_threads']} thr, nice {p['nice']})" for p in seen)
    verdict = (
        f"all on cpus {want}"
        if not off
        else "NOT all pinned: " + ", ".join(f"{p['name']} on {p['cpus']}" for p in off)
    )
    return f"  {name:24} {_count(len(seen), 'process')}, {verdict}: {procs}"


def banner(setup: dict[str, Any]) -> str:
    rows = [
        "what ran where",
        f"  cpus     {setup['cpus']} ({setup['cpu_count']} of {setup['machine_cpus']} on this "
        "machine): every process of every system started here is pinned to them",
        f"  dtype    {setup['dtype']} for every system ({setup['dtype_why']})",
        f"  prompts  {_prompts_line(setup)}",
        f"  client   this process (pid {setup['client']['pid']}), cpus "
        f"{setup['client']['cpus']}, not pinned",
    ]
    rows += [_system_line(name, s) for name, s in setup["systems"].items()]
    observed = [(n, s) for n, s in setup["systems"].items() if s.get("observed")]
    if observed:
        rows.append("read back from /proc after the runs")
        rows += [_observed_line(n, s) for n, s in observed]
    return "\n".join(rows)


# --- the report -------------------------------------------------------------------------


def _ratio(base: dict[str, Any], r: dict[str, Any]) -> str:
    if not (r["output_tok_s"] and r["ttft_p50_ms"] and r["itl_p99_ms"]):
        return "n/a: nothing measured"
    return (
        f"{base['output_tok_s'] / r['output_tok_s']:.2f}x tok/s, TTFT p50 "
        f"{base['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x, ITL p99 "
        f"{base['itl_p99_ms'] / r['itl_p99_ms']:.2f}x"
    )


def _cached(r: dict[str, Any], s: dict[str, Any]) -> str:
    """Share of prompt tokens served from cache, where the server reports it truthfully."""
    known = s.get("reports_cached_tokens") or r["cached_tokens"] > 0
    return f"{r['cached_tokens'] / r['prompt_tokens']:.0%}" if known and r["prompt_tokens"] else "-"


def render(report: dict[str, Any]) -> str:
    w, setup = report["workload"], report["setup"]
    rows = [
        banner(setup),
        "",
        f"serving benchmark: {w['prompt_tokens']}+{w['output_tokens']} tokens, "
        f"{w['rounds']} rounds after {w['warmup']} warm-up, prompts {w['prompts_label']}, "
        f"{w['dtype']}",
    ]
    base = report["systems"].get("halfmoon")
    compare = base is not None and len(report["systems"]) > 1  # a "vs" column needs both
    for c in report["concurrency"]:
        rows += [
            "",
            f"concurrency {c}",
            f"{'system':26}{'out tok/s':>10}{'TTFT p50':>10}"
            f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'e2e p50':>9}{'cached':>7}"
            f"{'fail':>5}" + ("  halfmoon vs this" if compare else ""),
        ]
        for name, by_c in report["systems"].items():
            r, s = by_c[str(c)], setup["systems"][name]
            ratio = ""
            if compare and name != "halfmoon":
                ratio = "  " + (
                    _ratio(base[str(c)], r)
                    if not (w["prompts"] == "fixed" and s["prefix_cache"] == "none")
                    else "n/a: no prefix cache, and the prompts are cache-friendly"
                )
            rows.append(
                f"{name:26}{r['output_tok_s']:>10.1f}{r['ttft_p50_ms']:>10.0f}"
                f"{r['ttft_p99_ms']:>10.0f}{r['itl_p50_ms']:>9.0f}{r['itl_p99_ms']:>9.0f}"
                f"{r['e2e_p50_ms']:>9.0f}{_cached(r, s):>7}{r['failures']:>5}{ratio}"
            )
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--systems",
        default="halfmoon,transformers-cb,transformers",
        help="servers to start and compare (halfmoon, transformers-cb, transformers)",
    )
    p.add_argument(
        "--url", action="append", default=[], help="also measure this OpenAI-compatible URL"
    )
    p.add_argument("--model", default="", help="model folder (default: the pulled default model)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto | float32 | bfloat16 (auto: bfloat16 where the CPU computes it natively)",
    )
    p.add_argument(
        "--cpus",
        default="",
        help="CPUs every started system is pinned to, e.g. 0-3 (default: all this process may use)",
    )
    p.add_argument("--halfmoon-args", default="", help="extra flags for halfmoon up")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sweep", default="", help="concurrency levels, e.g. 1,4,16,64")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--prompts",
        choices=["fresh", "fixed"],
        default="fresh",
        help="fresh: prompts never sent before in every round and the warm-up; "
        "fixed: the same ones every round (cache-friendly)",
    )
    p.add_argument(
        "--prompt-seed",
        default="",
        help="makes the prompts (default: a new "
        "random one per run, so even a long-running --url server has not seen them)",
    )
    p.add_argument("--request-timeout-s", type=float, default=600)
    p.add_argument(
        "--eos-style",
        choices=["ignore_eos", "generation_config", "none"],
        default="ignore_eos",
        help="how --url servers are asked to ignore end of sequence",
    )
    p.add_argument("--json-out", default="")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.prompt_seed = args.prompt_seed or secrets.token_hex(4)
    model_dir = ensure_model(args.model)
    levels = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.concurrency]
    servers = servers_for([s for s in args.systems.split(",") if s], model_dir, args)
    maker = PromptMaker(model_dir, args.prompt_tokens)
    report: dict[str, Any] = {
        "workload": {
            k: getattr(args, k)
            for k in (
                "prompt_tokens",
                "output_tokens",
                "rounds",
                "warmup",
                "prompts",
                "prompt_seed",
            )
        },
        "concurrency": levels,
        "setup": setup_for(args, servers),
        "systems": {},
    }
    report["workload"].update(
        dtype=report["setup"]["dtype"], prompts_label=PROMPT_LABELS[args.prompts]
    )
    print(banner(report["setup"]), file=sys.stderr, flush=True)
    for server in servers:
        print(f"measuring {server.name} ...", file=sys.stderr, flush=True)
        try:
            by_level, seen = measure(server, "", maker, args, levels)
        except (RuntimeError, TimeoutError) as exc:  # the others' figures still count
            print(f"{server.name} failed: {exc}", file=sys.stderr, flush=True)
            report["setup"]["systems"][server.name]["error"] = str(exc)[-2000:]
            continue
        report["systems"][server.name] = by_level
        report["setup"]["systems"][server.name]["observed"] = seen
    for url in args.url:
        report["systems"][url] = measure(None, url, maker, args, levels)[0]
    print(json.dumps(report, indent=2))
    print(render(report), file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0
