"""`halfmoon bench request`: one request's TTFT and total latency through the stack,
against the same generation done in-process (same model, dtype and thread count).

The stack's extra cost is the price of disaggregation: HTTP, NATS hops, the KV handoff.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any, Sequence

import aiohttp

from shared.model_store import ensure_model


async def _stack_once(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
    return {"ttft_s": ttft or float("nan"), "total_s": time.perf_counter() - t0, "tokens": tokens}


def _inprocess(model_dir: str, dtype: str, threads: int, prompt: str, max_tokens: int,
               runs: int) -> list[dict[str, float]]:
    """transformers `generate` on the same model: TTFT is a one-token generate."""
    import torch

    from shared.engine.runner import load_model

    lm = load_model(model_dir, dtype, threads=threads)
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True)["input_ids"]
    x = torch.tensor([ids])
    out = []
    with torch.inference_mode():
        for _ in range(runs + 1):  # the first run warms up
            t0 = time.perf_counter()
            lm.model.generate(x, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            lm.model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False)
            out.append({"ttft_s": ttft, "total_s": time.perf_counter() - t0, "tokens": max_tokens})
    return out[1:]


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{args.url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
    stack = []
    for _ in range(args.runs + 1):
        stack.append(await _stack_once(args.url, model, args.prompt, args.max_tokens))
    stack = stack[1:]
    local = await asyncio.to_thread(_inprocess, str(ensure_model(args.model)), args.dtype,
                                    args.threads, args.prompt, args.max_tokens, args.runs)
    result = {"model": model, "dtype": args.dtype, "threads": args.threads,
              "max_tokens": args.max_tokens, "runs": args.runs}
    for name, rows in (("stack", stack), ("in_process", local)):
        result[name] = {"ttft_ms": round(_median(rows, "ttft_s") * 1e3, 1),
                        "total_ms": round(_median(rows, "total_s") * 1e3, 1),
                        "tokens": rows[0]["tokens"]}
    result["ttft_overhead_ms"] = round(result["stack"]["ttft_ms"] - result["in_process"]["ttft_ms"], 1)
    result["total_ratio"] = round(result["stack"]["total_ms"] / result["in_process"]["total_ms"], 3)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench request", description=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running gateway")
    p.add_argument("--model", default="", help="model folder for the in-process baseline")
    p.add_argument("--dtype", default="auto", help="dtype the stack runs (match it; auto as the stack resolves it)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in-process (match one instance)")
    p.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    print(f"\n{'':12}{'TTFT ms':>10}{'total ms':>10}")
    for name in ("stack", "in_process"):
        print(f"{name:12}{result[name]['ttft_ms']:>10}{result[name]['total_ms']:>10}")
    return 0
