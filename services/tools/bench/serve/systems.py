"""`bench serve`'s systems: each server at each precision it has, on the same CPUs, measured
level by level, and what ran where (the setup the banner and the JSON report)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from services.tools.bench import llama_cpp
from services.tools.bench.placement import Placement, format_cpus, parse_cpus, placements
from services.tools.bench.serve.workload import (
    PROMPT_LABELS,
    PromptMaker,
    prompt_modes,
    run_rounds,
)
from services.tools.bench.servers import HalfmoonServer, LlamaCppServer, Server, TransformersServer
from shared.engine import cpu

PRECISIONS = ("fp32", "bf16", "int8", "q4_1")
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
# Halfmoon's engine flags per precision: (--dtype, --quantization).
HALFMOON_PRECISION = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
}
TRANSFORMERS_PRECISION = {"fp32": "float32", "bf16": "bfloat16"}


# halfmoon: `halfmoon up`'s disaggregated layout (1 prefill + 1 decode unless --halfmoon-args
# says otherwise); halfmoon-colocated: one instance that prefills and decodes on every
# thread, the usual single-process layout, on the same cores.
SYSTEMS = ("halfmoon", "halfmoon-colocated", "llama.cpp", "transformers-cb", "transformers")


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
    if system.startswith("halfmoon") and precision not in HALFMOON_PRECISION:
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
    where: tuple[Placement, Placement],
    spec: bool = False,
    prompt_tokens: int = 0,
) -> Server:
    """One system at one precision, on its placement (llama.cpp and transformers serve
    are one process each: the second placement, with Halfmoon's thread total). `spec`:
    with speculative decoding, each its own n-gram kind (Halfmoon's prompt lookup with
    --spec-tokens drafts, llama-server's --llama-cpp-spec). `prompt_tokens`: the longest
    prompt llama.cpp's slots must hold (default: --prompt-tokens)."""
    halfmoon, single = where
    server: Server
    if system.startswith("halfmoon"):
        dtype, quantization = HALFMOON_PRECISION[precision]
        extra, placement = args.halfmoon_args.split(), halfmoon
        if system == "halfmoon-colocated":  # one engine with every thread of the layout
            extra += ["--colocated", "1"]
            placement = Placement(halfmoon.cpus, 1, halfmoon.total_threads)
        if spec:
            extra += ["--num-speculative-tokens", str(args.spec_tokens)]
        server = HalfmoonServer(model_dir, dtype, placement, extra, quantization=quantization)
        server.name = system
    elif system == "llama.cpp":
        exe, root = llama_cpp_build()
        kind = llama_cpp.GGUF_FOR_PRECISION[precision]
        source = llama_cpp.fetch_source(root, llama_cpp.LlamaCppSettings().llama_cpp_sdist)
        gguf = llama_cpp.make_gguf(root, source, model_dir, kind)  # made once, then reused
        prompt = max(prompt_tokens, args.prompt_tokens)
        slot = llama_cpp.slot_tokens(prompt, args.output_tokens)
        flags = ["--spec-type", args.llama_cpp_spec] if spec else []
        server = LlamaCppServer(model_dir, exe, gguf, kind, single, slot, flags)
    else:
        server = TransformersServer(
            model_dir, TRANSFORMERS_PRECISION[precision], single, system.endswith("-cb")
        )
    server.precision = precision
    return server


def speculation(args: argparse.Namespace, system: str) -> list[bool]:
    """Without speculation, with it, or both (--speculation), for a system that has it
    (transformers serve has none: it runs without)."""
    if system.startswith("transformers"):
        return [False]
    return {"off": [False], "on": [True], "both": [False, True]}[args.speculation]


def servers_for(
    names: list[str], model_dir: Path, args: argparse.Namespace, prompt_tokens: int = 0
) -> list[Server]:
    """Every system at each precision it has (transformers' own "auto" dtype means the
    checkpoint's, not this CPU's best: each gets a concrete one), on the same CPUs and
    threads in total. With more than one precision, names carry it (halfmoon-int8); with
    speculation, a -spec suffix. `prompt_tokens`: the longest prompt (make_server)."""
    precisions = precisions_for(args)
    both = placements(parse_cpus(args.cpus), args.halfmoon_args.split())
    made: list[Server] = []
    for name in names:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r} (choose from {', '.join(SYSTEMS)})")
        for precision in precisions:
            if unavailable(name, precision):
                continue
            for spec in speculation(args, name):
                server = make_server(name, precision, model_dir, args, both, spec, prompt_tokens)
                if len(precisions) > 1 and name != "llama.cpp":  # llama.cpp's names the GGUF
                    server.name = f"{server.name}-{precision}"
                server.name += "-spec" if spec else ""
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
