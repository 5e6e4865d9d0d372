"""`halfmoon bench serve`: Halfmoon side by side with llama.cpp's `llama-server` and
`transformers serve` (with and without its continuous batching), or any OpenAI-compatible
URL, on one workload.

Workload: N concurrent streaming chat requests (default 16) whose chat-templated prompts
are ~P tokens (default 256), each producing exactly T tokens (default 64; end of sequence
ignored via `ignore_eos` and transformers' `generation_config.min_new_tokens`; the usage
each server reports is checked, in the table's "!=T" column), for R rounds after a warm-up
round, at each concurrency level.

Prompts: `--prompts fresh` (the default) gives every round, the warm-up included, prompts
never sent before, to every system: each starts with its own system message, so no two
share even their first KV block and no prefix cache can serve any of them. `--prompts
fixed` ("cache-friendly") sends the same N prompts every round, the warm-up included, so
a server with a prefix cache serves the repeats from it. `--prompts fresh,fixed` runs
both, on each server as started (fresh first, at each level).

Precisions (`--precisions fp32,int8`, default: `--dtype`'s): each system runs at each one
it has, and the table compares each with Halfmoon at the same precision. Halfmoon: fp32,
bf16, int8 (`--quantization int8`, fp32 activations); llama.cpp: the GGUF holding the same
weights alike (f32, bf16, Q8_0) and q4_1, the model's own file; transformers: fp32, bf16.

llama.cpp (`--systems llama.cpp`) needs `halfmoon bench build-llama-cpp` once (never run
here): llama-server runs with --parallel equal to the concurrency (started again at each
level), the context to match, and as many threads as Halfmoon's engines hold in total.

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

from services.tools.bench import llama_cpp
from services.tools.bench.client import Result, stream_chat
from services.tools.bench.servers import (
    HalfmoonServer,
    LlamaCppServer,
    Placement,
    Server,
    TransformersServer,
    format_cpus,
    parse_cpus,
    placements,
)
from shared.engine import cpu
from shared.model_store import ensure_model
from shared.stats import percentile

WORDS = (
    "moon tide harbor lantern river stone garden winter signal orbit copper meadow "
    "engine archive bridge falcon canyon ember glacier harvest island jungle kettle"
).split()
PROMPT_LABELS = {"fresh": "fresh", "fixed": "cache-friendly"}
PRECISIONS = ("fp32", "bf16", "int8", "q4_1")
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
# Halfmoon's engine flags per precision: (--dtype, --quantization).
HALFMOON_PRECISION = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
}
TRANSFORMERS_PRECISION = {"fp32": "float32", "bf16": "bfloat16"}
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


def body(
    model: str,
    messages: Messages,
    out_tokens: int,
    eos_style: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request; how to ask for exactly `out_tokens` depends on the server: Halfmoon,
    llama.cpp and vLLM take `ignore_eos`, transformers serve a `generation_config` (and
    refuses fields it does not know). `extra`: what else a server is sent (llama.cpp:
    cache_prompt)."""
    b: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": out_tokens,
        "temperature": 0,
        **(extra or {}),
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


def prompt_modes(spec: str) -> list[str]:
    """ "fresh,fixed" -> ["fresh", "fixed"]."""
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in PROMPT_LABELS]
    if bad or not modes:
        raise SystemExit(f"--prompts: choose from fresh, fixed (comma separated), not {spec!r}")
    return modes


async def run_rounds(
    url: str,
    maker: PromptMaker,
    args: argparse.Namespace,
    concurrency: int,
    eos_style: str,
    mode: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One level under one prompt mode (default: the first of --prompts)."""
    mode = mode or prompt_modes(args.prompts)[0]
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model = await model_id(http, url, str(maker.model_dir))
        results: list[Result] = []
        wall = 0.0
        for rnd in range(args.warmup + args.rounds):
            tag = prompt_tag(mode, args.prompt_seed, concurrency, rnd)
            prompts = maker.round(tag, concurrency)
            t0 = time.perf_counter()
            batch = await asyncio.gather(
                *(
                    stream_chat(http, url, body(model, p, args.output_tokens, eos_style, extra))
                    for p in prompts
                )
            )
            if rnd >= args.warmup:
                wall += time.perf_counter() - t0
                results.extend(batch)
    return summarize(results, wall, args.output_tokens)


def summarize(results: list[Result], wall: float, output_tokens: int = 0) -> dict[str, Any]:
    """The level's figures; `wrong_length` counts answers whose usage says they did not
    produce exactly `output_tokens` (0: not checked)."""
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
        "wrong_length": sum(
            1 for r in ok if output_tokens and r.completion_tokens != output_tokens
        ),
        "errors": sorted({r.error for r in results if r.error})[:3],
    }


SYSTEMS = ("halfmoon", "llama.cpp", "transformers-cb", "transformers")


def precisions_for(args: argparse.Namespace) -> list[str]:
    """--precisions as a list; without it, the one --dtype resolves to on this CPU."""
    if not args.precisions:
        return [PRECISION_OF_DTYPE[cpu.resolve_dtype(args.dtype)[0]]]
    wanted = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in wanted if p not in PRECISIONS]
    if bad or not wanted:
        raise SystemExit(f"--precisions: choose from {', '.join(PRECISIONS)}, not {bad}")
    return wanted


def unavailable(system: str, precision: str) -> str:
    """Why `system` cannot run at `precision` (empty: it can)."""
    if system == "halfmoon" and precision not in HALFMOON_PRECISION:
        return f"Halfmoon's engine has no {precision}"
    if system.startswith("transformers") and precision not in TRANSFORMERS_PRECISION:
        return f"transformers serve has no {precision} here"
    return ""


def llama_cpp_build() -> tuple[Path, Path]:
    """(llama-server, its cache folder) of the finished build, or a clear exit: the bench
    never builds it (that takes minutes; `halfmoon bench build-llama-cpp` does, once)."""
    from shared.settings import settings_from

    root = llama_cpp.home(settings_from(llama_cpp.LlamaCppSettings))
    exe = llama_cpp.built_server(root)
    if exe is None:
        raise SystemExit(
            f"llama.cpp is not built in {root}: run `halfmoon bench build-llama-cpp` once "
            "(10 to 30 minutes on 2 cores: 626 s and 1,682 s on two EPYCs), or leave llama.cpp "
            "out of --systems"
        )
    return exe, root


def make_server(
    system: str,
    precision: str,
    model_dir: Path,
    args: argparse.Namespace,
    halfmoon: Placement,
    single: Placement,
) -> Server:
    """One system at one precision, on its placement (llama.cpp and transformers serve
    are one process each: `single`, with Halfmoon's thread total)."""
    server: Server
    if system == "halfmoon":
        dtype, quantization = HALFMOON_PRECISION[precision]
        server = HalfmoonServer(
            model_dir, dtype, halfmoon, args.halfmoon_args.split(), quantization=quantization
        )
    elif system == "llama.cpp":
        exe, root = llama_cpp_build()
        kind = llama_cpp.GGUF_FOR_PRECISION[precision]
        source = llama_cpp.fetch_source(root, llama_cpp.LlamaCppSettings().llama_cpp_sdist)
        gguf = llama_cpp.make_gguf(root, source, model_dir, kind)  # made once, then reused
        slot = llama_cpp.slot_tokens(args.prompt_tokens, args.output_tokens)
        server = LlamaCppServer(model_dir, exe, gguf, kind, single, slot)
    else:
        server = TransformersServer(
            model_dir, TRANSFORMERS_PRECISION[precision], single, system.endswith("-cb")
        )
    server.precision = precision
    return server


def servers_for(names: list[str], model_dir: Path, args: argparse.Namespace) -> list[Server]:
    """Every system at each precision it has (transformers' own "auto" dtype means the
    checkpoint's, not this CPU's best: each gets a concrete one), on the same CPUs and
    threads in total. With more than one precision, names carry it (halfmoon-int8)."""
    precisions = precisions_for(args)
    halfmoon, single = placements(parse_cpus(args.cpus), args.halfmoon_args.split())
    made: list[Server] = []
    for name in names:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r} (choose from {', '.join(SYSTEMS)})")
        for precision in precisions:
            if unavailable(name, precision):
                continue
            server = make_server(name, precision, model_dir, args, halfmoon, single)
            if len(precisions) > 1 and name != "llama.cpp":  # llama.cpp's names the GGUF
                server.name = f"{server.name}-{precision}"
            made.append(server)
    return made


def measure(
    server: Server | None,
    url: str,
    maker: PromptMaker,
    args: argparse.Namespace,
    levels: list[int],
    modes: list[str] | None = None,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """({prompt mode: {concurrency: summary}}, the server's processes as seen after its
    last level). Levels in order, and at each every prompt mode (fresh first); a server
    that restarts per level is started again for each."""
    modes = modes or prompt_modes(args.prompts)
    by_mode: dict[str, dict[str, Any]] = {m: {} for m in modes}
    seen: list[dict[str, Any]] = []
    try:
        for c in levels:
            # Starting inside the try: a server that dies starting is cleaned up too.
            if server is not None and server.restarts_per_level:
                server.stop()
                server.at_concurrency(c)
                server.start()
            elif server is not None and server.proc is None:
                server.start()
            for m in modes:
                target = server.url if server is not None else url
                style = server.eos_style if server is not None else args.eos_style
                extra = server.request_extra if server is not None else None
                by_mode[m][str(c)] = asyncio.run(
                    run_rounds(target, maker, args, c, style, m, extra)
                )
            seen = server.observe() if server is not None else []
        return by_mode, seen
    finally:
        if server is not None:
            server.stop()


# --- what ran where ---------------------------------------------------------------------


def precision_flags(server: Server) -> str:
    """How the server is told its precision, as it is started."""
    if isinstance(server, LlamaCppServer):
        return f"GGUF {server.kind} ({server.gguf.name})"
    if isinstance(server, HalfmoonServer) and server.quantization != "none":
        return f"--dtype {server.dtype} --quantization {server.quantization}"
    return f"--dtype {server.dtype}"


def system_setup(server: Server) -> dict[str, Any]:
    p: Placement = server.placement
    setup: dict[str, Any] = {
        "placement": p.as_dict(),
        "env": p.env(),
        "command": server.command(),
        "precision": server.precision,
        "precision_flags": precision_flags(server),
        "prefix_cache": server.prefix_cache,
        "reports_cached_tokens": server.reports_cached_tokens,
        "request_extra": server.request_extra,
        "eos_style": server.eos_style,
    }
    if isinstance(server, LlamaCppServer):
        setup["llama_cpp"] = {
            "slot_ctx": server.slot_ctx,
            "parallel": "the concurrency (started again at each level)",
            "build": llama_cpp.build_info(server.exe.parents[2]),
        }
    return setup


def setup_for(args: argparse.Namespace, servers: list[Server]) -> dict[str, Any]:
    dtype, why = cpu.resolve_dtype(args.dtype)
    cpus = parse_cpus(args.cpus)
    systems = {s.name: system_setup(s) for s in servers}
    systems.update(
        {url: {"placement": None, "prefix_cache": "unknown (external)"} for url in args.url}
    )
    modes = prompt_modes(args.prompts)
    return {
        "cpus": format_cpus(cpus),
        "cpu_count": len(cpus),
        "machine_cpus": os.cpu_count(),
        "cpu_model": llama_cpp.cpu_model(),
        "dtype": dtype,
        "dtype_why": why,
        "precisions": precisions_for(args),
        "precisions_why": "set with --precisions" if args.precisions else f"--dtype: {why}",
        "skipped": [
            f"{n} at {p}: {unavailable(n, p)}"
            for n in args.systems.split(",")
            if n
            for p in precisions_for(args)
            if unavailable(n, p)
        ],
        "prompts": modes,
        "prompts_labels": {m: PROMPT_LABELS[m] for m in modes},
        "prompt_seed": args.prompt_seed,
        "client": {"pid": os.getpid(), "cpus": format_cpus(sorted(os.sched_getaffinity(0)))},
        "systems": systems,
    }


def _prompts_line(mode: str, seed: str) -> str:
    if mode == "fresh":
        return (
            "fresh: every round and the warm-up send prompts never sent before "
            f"(seed {seed}); no prefix cache can serve them"
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
    unit = "engine" if name.startswith("halfmoon") else "process"
    line = (
        f"  {name:24} {_count(p['processes'], unit)} x {_count(p['threads'], 'thread')} "
        f"({p['total_threads']} in total, OMP_NUM_THREADS={s['env']['OMP_NUM_THREADS']}) "
        f"on cpus {p['cpus']}; {s['precision_flags']}"
    )
    if "llama_cpp" in s:
        t = p["total_threads"]
        line += (
            f"; --threads {t} --threads-batch {t}, --parallel = the concurrency "
            f"(started again at each level), --ctx-size = parallel x {s['llama_cpp']['slot_ctx']}"
            ", --cont-batching --cache-prompt, cache_prompt and ignore_eos in each request"
        )
    return line + f"; prefix cache: {s['prefix_cache']}"


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
        f"machine, {setup['cpu_model']}): every process of every system started here is "
        "pinned to them",
        f"  precision {', '.join(setup['precisions'])} ({setup['precisions_why']}); each "
        "system at each it has, compared with Halfmoon at the same one",
    ]
    rows += [f"  skipped  {line}" for line in setup["skipped"]]
    rows += [f"  prompts  {_prompts_line(m, setup['prompt_seed'])}" for m in setup["prompts"]]
    rows.append(
        f"  client   this process (pid {setup['client']['pid']}), cpus "
        f"{setup['client']['cpus']}, not pinned"
    )
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


def halfmoon_at(report: dict[str, Any], precision: str) -> str:
    """The name of the Halfmoon run at `precision` (empty: none measured)."""
    for name, s in report["setup"]["systems"].items():
        if name.startswith("halfmoon") and s.get("precision") == precision:
            if name in report["systems"]:
                return name
    return ""


def _vs(report: dict[str, Any], name: str, mode: str, c: str) -> str:
    """The "halfmoon vs this" cell: Halfmoon at this system's precision against it."""
    s = report["setup"]["systems"][name]
    if name.startswith("halfmoon"):
        return ""
    if mode == "fixed" and s.get("prefix_cache") == "none":
        return "n/a: no prefix cache, and the prompts are cache-friendly"
    precision = s.get("precision") or report["setup"]["precisions"][0]  # external: the first
    base = halfmoon_at(report, precision)
    if not base:
        return f"n/a: no Halfmoon run at {precision}"
    return _ratio(report["systems"][base][mode][c], report["systems"][name][mode][c])


def _header(compare: bool) -> str:
    return (
        f"{'system':26}{'out tok/s':>10}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'e2e p50':>9}{'cached':>7}"
        f"{'fail':>5}{'!=T':>5}" + ("  halfmoon vs this" if compare else "")
    )


def _row(name: str, r: dict[str, Any], s: dict[str, Any], vs: str) -> str:
    return (
        f"{name:26}{r['output_tok_s']:>10.1f}{r['ttft_p50_ms']:>10.0f}"
        f"{r['ttft_p99_ms']:>10.0f}{r['itl_p50_ms']:>9.0f}{r['itl_p99_ms']:>9.0f}"
        f"{r['e2e_p50_ms']:>9.0f}{_cached(r, s):>7}{r['failures']:>5}"
        f"{r.get('wrong_length', 0):>5}" + (f"  {vs}" if vs else "")
    )


def render(report: dict[str, Any]) -> str:
    """The banner, then one table per prompt mode and concurrency level. "!=T" counts the
    answers whose usage says they were not exactly T tokens long (which would skew tok/s)."""
    w, setup = report["workload"], report["setup"]
    rows = [
        banner(setup),
        "",
        f"serving benchmark: {w['prompt_tokens']}+{w['output_tokens']} tokens, "
        f"{w['rounds']} rounds after {w['warmup']} warm-up, "
        f"precision {', '.join(setup['precisions'])}",
    ]
    names = list(report["systems"])
    compare = any(n.startswith("halfmoon") for n in names) and len(names) > 1
    for name, s in setup["systems"].items():  # a system that failed is said, not left out
        if s.get("error"):
            last = s["error"].strip().splitlines()[-1:] or ["(no output)"]
            rows.append(f"  {name} did not run: {last[0][:200]}")
    for mode in w["prompts"]:
        for c in report["concurrency"]:
            rows += ["", f"prompts {w['prompts_labels'][mode]}, concurrency {c}", _header(compare)]
            for name in names:
                r = report["systems"][name][mode][str(c)]
                s = setup["systems"][name]
                rows.append(_row(name, r, s, _vs(report, name, mode, str(c)) if compare else ""))
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
        help="servers to start and compare (halfmoon, llama.cpp, transformers-cb, "
        "transformers); llama.cpp needs `halfmoon bench build-llama-cpp` once",
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
        "--precisions",
        default="",
        help="precisions to run each system at, e.g. fp32,int8 (fp32, bf16, int8, q4_1; "
        "default: the one --dtype resolves to)",
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
        default="fresh",
        help="fresh: prompts never sent before in every round and the warm-up; "
        "fixed: the same ones every round (cache-friendly); fresh,fixed: both",
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
    modes = prompt_modes(args.prompts)
    model_dir = ensure_model(args.model)
    levels = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.concurrency]
    servers = servers_for([s for s in args.systems.split(",") if s], model_dir, args)
    maker = PromptMaker(model_dir, args.prompt_tokens)
    report: dict[str, Any] = {
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "prompts": modes,
            "prompts_labels": {m: PROMPT_LABELS[m] for m in modes},
            "prompt_seed": args.prompt_seed,
        },
        "concurrency": levels,
        "setup": setup_for(args, servers),
        "systems": {},
    }
    print(banner(report["setup"]), file=sys.stderr, flush=True)
    for server in servers:
        print(f"measuring {server.name} ...", file=sys.stderr, flush=True)
        try:
            by_mode, seen = measure(server, "", maker, args, levels, modes)
        except (RuntimeError, TimeoutError) as exc:  # the others' figures still count
            print(f"{server.name} failed: {exc}", file=sys.stderr, flush=True)
            report["setup"]["systems"][server.name]["error"] = str(exc)[-2000:]
            continue
        report["systems"][server.name] = by_mode
        report["setup"]["systems"][server.name]["observed"] = seen
    for url in args.url:
        report["systems"][url] = measure(None, url, maker, args, levels, modes)[0]
    print(json.dumps(report, indent=2))
    print(render(report), file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
