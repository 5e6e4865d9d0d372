"""`halfmoon bench handoff`: the gap a KV handoff puts into a stream, with the KV streamed
to decode while prefill runs against the whole KV moved after the first token.

The gap is the client's time from the first streamed token (prefill's) to the second
(decode's first): the handoff plus one decode step. Moved after the first token, the KV
of the whole prompt is copied then, so the gap grows with the prompt. Streamed, the blocks
of every chunk but the last went to decode while the next chunk ran, so it should stay
about flat. The later gaps (decode steps alone) are printed beside it as the floor.

Fair by construction: each mode gets a fresh `halfmoon up --prefill 1 --decode 1` on the
same cores with the same thread split, the same prompts (each its own from its first
token, so neither reuses a cached block) and the same warm-up request; only
HALFMOON_STREAM_HANDOFF differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from services.tools.bench.client import Result, stream_chat
from services.tools.bench.replay.cluster import ClusterConfig, local_cluster
from services.tools.bench.request_latency import stack_body
from services.tools.bench.serve.workload import Messages, PromptMaker
from shared.engine import cpu
from shared.model_store import ensure_model

MODES = {"after-prefill": "false", "streamed": "true"}


# The gateway's first-token wait (300 s by default) is shorter than one core's 32k
# prefill on a slow CPU: the bench waits as long as its client does.
LONG_WAITS = {"HALFMOON_FIRST_TOKEN_TIMEOUT_S": "3600"}


def body(model: str, messages: Messages, max_tokens: int) -> dict[str, Any]:
    # This measures the handoff, not admission: a 32k prompt alone is served however
    # slowly the CPU prefills it (the default 30 s TTFT SLO refuses it on some).
    slos = {"ttft_slo_ms": 3_600_000, "tbt_slo_ms": 60_000}
    return {**stack_body(model, messages, max_tokens), **slos}


def handoff_gap_s(res: Result) -> float:
    """First content chunk (prefill's token) to the second (decode's first)."""
    if len(res.chunk_times) < 2:
        raise RuntimeError(f"request {res.request_id} streamed fewer than two chunks")
    return res.chunk_times[1] - res.chunk_times[0]


async def _run_mode(
    mode: str, args: argparse.Namespace, model_dir: Path, prompts: dict[int, list[Messages]]
) -> dict[int, list[Result]]:
    flags = ("--prefill", "1", "--decode", "1", *args.up_flags)
    config = ClusterConfig(mode, flags, {**LONG_WAITS, "HALFMOON_STREAM_HANDOFF": MODES[mode]})
    out: dict[int, list[Result]] = {}
    with tempfile.TemporaryDirectory() as logs:
        async with local_cluster(config, model_dir, Path(logs)) as url:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
                warm = PromptMaker(model_dir, min(args.sizes)).one("handoff-warm", 0)
                await _one(http, url, model_dir.name, warm, args.max_tokens)
                for size, batch in prompts.items():  # one at a time: the gap alone
                    out[size] = [
                        await _one(http, url, model_dir.name, m, args.max_tokens) for m in batch
                    ]
    return out


async def _one(
    http: aiohttp.ClientSession, url: str, model: str, messages: Messages, max_tokens: int
) -> Result:
    res = await stream_chat(http, url, body(model, messages, max_tokens))
    if not res.ok:
        raise RuntimeError(f"the stack failed a request: {res.status} {res.error}")
    return res


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 1)


def summarize(results: dict[str, dict[int, list[Result]]]) -> list[dict[str, Any]]:
    rows = []
    for size in next(iter(results.values())):
        row: dict[str, Any] = {"prompt_tokens": results["streamed"][size][0].prompt_tokens}
        for mode, by_size in results.items():
            runs = by_size[size]
            row[f"{mode}_gap_ms"] = _median_ms([handoff_gap_s(r) for r in runs])
            row[f"{mode}_later_gap_ms"] = _median_ms([g for r in runs for g in r.gaps_s[1:]])
            row[f"{mode}_ttft_ms"] = _median_ms([r.ttft_s or 0.0 for r in runs])
        row["streamed_over_after_prefill"] = round(
            row["streamed_gap_ms"] / row["after-prefill_gap_ms"], 3
        )
        rows.append(row)
    first = rows[0]
    for row in rows:  # flat: each size's gap against the smallest prompt's
        for mode in MODES:
            row[f"{mode}_gap_vs_smallest"] = round(
                row[f"{mode}_gap_ms"] / first[f"{mode}_gap_ms"], 2
            )
    return rows


def render(rows: list[dict[str, Any]], machine: str) -> str:
    lines = [
        f"KV handoff gap (first to second streamed token), median ms; {machine}",
        "| prompt tokens | after prefill | streamed | streamed / after | later gaps "
        "(after / streamed) | gap vs smallest prompt (after / streamed) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['after-prefill_gap_ms']} | {r['streamed_gap_ms']} "
            f"| {r['streamed_over_after_prefill']}x | {r['after-prefill_later_gap_ms']} / "
            f"{r['streamed_later_gap_ms']} | {r['after-prefill_gap_vs_smallest']}x / "
            f"{r['streamed_gap_vs_smallest']}x |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = await asyncio.to_thread(ensure_model, args.model)
    prompts = {
        size: [PromptMaker(model_dir, size).one(f"handoff-{size}", i) for i in range(args.runs)]
        for size in args.sizes
    }
    results = {mode: await _run_mode(mode, args, model_dir, prompts) for mode in MODES}
    info = cpu.detect()
    machine = f"{info.model}, {len(os.sched_getaffinity(0))} cores, {info.level}"
    rows = summarize(results)
    return {"machine": machine, "runs": args.runs, "rows": rows, "table": render(rows, machine)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench handoff",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="model folder (default: the pulled default)")
    p.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[512, 2048, 8000],
        help="prompt sizes in tokens, chat template included",
    )
    p.add_argument("--runs", type=int, default=3, help="requests per size and mode")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--up-flag",
        dest="up_flags",
        action="append",
        default=[],
        help="an extra `halfmoon up` flag for both stacks (repeat it)",
    )
    p.add_argument("--json-out", default="", help="write the figures here too")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = asyncio.run(run(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["rows"], indent=2))
    print("\n" + result["table"])
    return 0
