"""`halfmoon bench request`: one request's TTFT and total latency through the stack,
against the same generation done in-process (same model, dtype and thread count).

The stack's extra cost is the price of disaggregation: HTTP, NATS hops, the KV handoff.

Both sides see the same prompts and reuse the same number of prompt tokens, so a cache
helps neither more than the other:
- `--prompts fresh` (the default): every run, the warm-up included, sends a prompt never
  sent before. Its own system message leads it, so it shares no KV block with any earlier
  request (not even the chat template's default system prompt): the stack reuses nothing,
  and neither does the baseline.
- `--prompts warm`: one prompt for every run; after the warm-up the stack serves its
  leading blocks from its prefix cache. The baseline gets a KV cache of exactly as many
  leading tokens as the stack reports cached for that run (built before the timing, and
  copied in untimed, as the stack's cached blocks are already in place).
Either way the reused tokens are reported for both.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import secrets
import statistics
import time
from typing import Any, Sequence

import aiohttp

from services.tools.bench.client import Result, stream_chat
from services.tools.bench.serve.workload import unique_lead
from shared.engine import cpu
from shared.model_store import ensure_model

Messages = list[dict[str, str]]
PROMPT_MODES = {
    "fresh": "a prompt never sent before in every run, warm-up included; nothing reused",
    "warm": "the same prompt in every run; after the warm-up both reuse the same cached prefix",
}


def run_prompts(mode: str, seed: str, prompt: str, runs: int) -> list[Messages]:
    """The messages of each run, the warm-up (index 0) included."""
    tags = (
        [f"{seed}-warm"] * (runs + 1)
        if mode == "warm"
        else [f"{seed}-{i}" for i in range(runs + 1)]
    )
    return [
        [{"role": "system", "content": unique_lead(tag)}, {"role": "user", "content": prompt}]
        for tag in tags
    ]


def stack_body(model: str, messages: Messages, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def _stack(url: str, model: str, prompts: list[Messages], max_tokens: int) -> list[Result]:
    out = []
    async with aiohttp.ClientSession() as http:
        for messages in prompts:  # one at a time: this measures one request alone
            res = await stream_chat(http, url, stack_body(model, messages, max_tokens))
            if not res.ok:
                raise RuntimeError(f"the stack failed a request: {res.status} {res.error}")
            out.append(res)
    return out


def reused_tokens(cached: int, prompt_len: int) -> int:
    """What the baseline may take from a cache: the stack's cached count, leaving at least
    one prompt token to compute (the first output token's logits come from it)."""
    return max(0, min(cached, prompt_len - 1))


def _inprocess(
    model_dir: str,
    dtype: str,
    threads: int,
    prompts: list[Messages],
    cached: list[int],
    max_tokens: int,
) -> list[dict[str, float]]:
    """transformers `generate` on the same model: TTFT is a one-token generate; run i
    starts from a KV cache of the first `cached[i]` tokens when that is not 0."""
    import torch
    from transformers import DynamicCache

    from shared.engine.runner import load_model

    lm = load_model(model_dir, dtype, threads=threads)
    # LoadedModel types its model and tokenizer loosely (any torch module, any tokenizer).
    model: Any = lm.model
    tok: Any = lm.tokenizer
    out = []
    with torch.inference_mode():
        for messages, hit in zip(prompts, cached):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
            x, k = torch.tensor([ids]), reused_tokens(hit, len(ids))
            prefix = None
            if k:
                prefix = DynamicCache(config=model.config)
                model(x[:, :k], cache=prefix, use_cache=True)
            times = []
            for n in (1, max_tokens):  # TTFT, then the whole generation
                kv = copy.deepcopy(prefix) if prefix is not None else None
                t0 = time.perf_counter()
                model.generate(x, cache=kv, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                times.append(time.perf_counter() - t0)
            out.append(
                {"ttft_s": times[0], "total_s": times[1], "tokens": max_tokens, "reused_tokens": k}
            )
    return out


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _side(rows: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "ttft_ms": round(_median(rows, "ttft_s") * 1e3, 1),
        "total_ms": round(_median(rows, "total_s") * 1e3, 1),
        "tokens": rows[0]["tokens"],
        "reused_tokens": int(_median(rows, "reused_tokens")),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{args.url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
    prompts = run_prompts(args.prompts, args.prompt_seed, args.prompt, args.runs)
    stack = await _stack(args.url, model, prompts, args.max_tokens)
    cached = [r.cached_tokens for r in stack]
    dtype = cpu.resolve_dtype(args.dtype)[0]
    local = await asyncio.to_thread(
        _inprocess,
        str(ensure_model(args.model)),
        dtype,
        args.threads,
        prompts,
        cached,
        args.max_tokens,
    )
    stack_rows = [
        {
            "ttft_s": r.ttft_s or float("nan"),
            "total_s": r.end_s,
            "tokens": r.completion_tokens,
            "reused_tokens": r.cached_tokens,
        }
        for r in stack
    ]
    result = {
        "model": model,
        "dtype": dtype,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "prompts": args.prompts,
        "prompts_meaning": PROMPT_MODES[args.prompts],
        "prompt_seed": args.prompt_seed,
        "prompt_tokens": stack[-1].prompt_tokens,
        "warmup_runs": 1,
        # the first run of each side warms it up and is not counted
        "stack": _side(stack_rows[1:]),
        "in_process": _side(local[1:]),
    }
    result["ttft_overhead_ms"] = round(
        result["stack"]["ttft_ms"] - result["in_process"]["ttft_ms"], 1
    )
    result["total_ratio"] = round(result["stack"]["total_ms"] / result["in_process"]["total_ms"], 3)
    return result


def render(result: dict[str, Any]) -> str:
    rows = [
        f"one request, {result['prompt_tokens']} prompt + {result['max_tokens']} output "
        f"tokens, median of {result['runs']} after a warm-up, {result['dtype']}",
        f"prompts {result['prompts']}: {result['prompts_meaning']}",
        f"in-process: transformers generate, {result['threads']} torch "
        f"thread{'' if result['threads'] == 1 else 's'}; the "
        "stack: as it runs (not pinned here)",
        "",
        f"{'':12}{'TTFT ms':>10}{'total ms':>10}{'reused tok':>12}",
    ]
    for name in ("stack", "in_process"):
        r = result[name]
        rows.append(f"{name:12}{r['ttft_ms']:>10}{r['total_ms']:>10}{r['reused_tokens']:>12}")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench request",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running gateway")
    p.add_argument("--model", default="", help="model folder for the in-process baseline")
    p.add_argument(
        "--dtype",
        default="auto",
        help="dtype the stack runs (match it; auto as the stack resolves it)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads in-process (match one instance)"
    )
    p.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    p.add_argument(
        "--prompts",
        choices=sorted(PROMPT_MODES),
        default="fresh",
        help="; ".join(f"{k}: {v}" for k, v in PROMPT_MODES.items()),
    )
    p.add_argument(
        "--prompt-seed",
        default="",
        help="makes the prompts unique (default: a "
        "new random one per run, so a long-running stack has not seen them)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.prompt_seed = args.prompt_seed or secrets.token_hex(4)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    print("\n" + render(result))
    return 0
