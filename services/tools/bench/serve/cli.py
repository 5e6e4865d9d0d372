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

`--prompts grounded` ("input-grounded") asks for answers that copy their prompt (repeat or
edit a function of Python's standard library), each led by a system message of its own as
fresh ones are; with `--speculation both`, Halfmoon and llama.cpp run without speculative
decoding and again with it (each its own n-gram drafter: Halfmoon's prompt lookup,
llama-server's `--spec-type ngram-simple`), to see what drafting gains where it finds drafts
and what it costs on fresh prompts.

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
import json
import secrets
import sys
from pathlib import Path
from typing import Any, Sequence

from services.tools.bench.serve.report import banner, render
from services.tools.bench.serve.systems import measure, servers_for, setup_for
from services.tools.bench.serve.workload import PROMPT_LABELS, PromptMaker, prompt_modes
from shared.model_store import ensure_model


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
    p.add_argument("--request-timeout-s", type=float, default=600)
    p.add_argument(
        "--eos-style",
        choices=["ignore_eos", "generation_config", "none"],
        default="ignore_eos",
        help="how --url servers are asked to ignore end of sequence",
    )
    _prompt_args(p)
    p.add_argument("--json-out", default="")
    return p


def _prompt_args(p: argparse.ArgumentParser) -> None:
    """Which prompts, and whether each system drafts its answers."""
    p.add_argument(
        "--prompts",
        default="fresh",
        help="fresh: prompts never sent before in every round and the warm-up; "
        "fixed: the same ones every round (cache-friendly); grounded: fresh ones whose "
        "answers copy the prompt; comma separated for several",
    )
    p.add_argument(
        "--prompt-seed",
        default="",
        help="makes the prompts (default: a new "
        "random one per run, so even a long-running --url server has not seen them)",
    )
    p.add_argument(
        "--speculation",
        choices=["off", "on", "both"],
        default="off",
        help="speculative decoding for Halfmoon and llama.cpp: off, on, or both (each "
        "system without it and again with it, named -spec)",
    )
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=4,
        help="Halfmoon's prompt-lookup drafts per step with speculation (--num-speculative-tokens)",
    )
    p.add_argument(
        "--llama-cpp-spec",
        default="ngram-simple",
        help="llama-server's --spec-type with speculation (its own n-gram drafter, its defaults)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.prompt_seed = args.prompt_seed or secrets.token_hex(4)
    modes = prompt_modes(args.prompts)
    model_dir = ensure_model(args.model)
    levels = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.concurrency]
    maker = PromptMaker(model_dir, args.prompt_tokens)
    longest = max(maker.longest(m) for m in modes)
    servers = servers_for([s for s in args.systems.split(",") if s], model_dir, args, longest)
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
