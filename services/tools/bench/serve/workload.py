"""`bench serve`'s workload: the prompts (fresh, cache-friendly or input-grounded), the
request each server is sent, one concurrency level's rounds and their figures."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import aiohttp

from services.tools.bench.client import Result, stream_chat
from services.tools.bench.grounded import grounded_prompts
from shared.stats import percentile

WORDS = (
    "moon tide harbor lantern river stone garden winter signal orbit copper meadow "
    "engine archive bridge falcon canyon ember glacier harvest island jungle kettle"
).split()
PROMPT_LABELS = {"fresh": "fresh", "fixed": "cache-friendly", "grounded": "input-grounded"}
Messages = list[dict[str, str]]


# --- prompts ----------------------------------------------------------------------------


def prompt_tag(mode: str, seed: str, concurrency: int, rnd: int) -> str:
    """What makes a round's prompts its own: under fresh and grounded, the run's seed, the
    level and the round (warm-up included); under fixed, only the seed."""
    if mode == "fixed":
        return f"{seed}-fixed"
    return f"{seed}-{mode}-c{concurrency}-r{rnd}"


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
        encoded: Any = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        return encoded["input_ids"]

    def one(self, tag: str, i: int, mode: str = "fresh") -> Messages:
        system = {"role": "system", "content": unique_lead(f"{tag}-{i}")}
        if mode == "grounded":  # a task drawn per prompt; the lead makes it fresh
            tasks = grounded_prompts()
            return [system, *random.Random(f"{tag}-{i}").choice(tasks)]
        rng = random.Random(f"{tag}-{i}")
        words: list[str] = []
        while True:
            messages = [system, {"role": "user", "content": " ".join(words)}]
            short = self.tokens - len(self.ids(messages))
            if short <= 0:
                return messages
            words.extend(rng.choice(WORDS) for _ in range(max(1, short // 2)))

    def round(self, tag: str, n: int, mode: str = "fresh") -> list[Messages]:
        """n prompts for one round; a fixed tag gives the same prompts every time."""
        made = self._made.setdefault(tag, [])
        made.extend(self.one(tag, i, mode) for i in range(len(made), n))
        return made[:n]

    def longest(self, mode: str) -> int:
        """Tokens of this mode's longest prompt (grounded ones are as long as their source;
        the others are made `tokens` long), so a server's context can hold each."""
        if mode != "grounded":
            return self.tokens
        lead = {"role": "system", "content": unique_lead("longest")}
        return max(len(self.ids([lead, *task])) for task in grounded_prompts())


# --- one request, one level -----------------------------------------------------------


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
        choices = ", ".join(PROMPT_LABELS)
        raise SystemExit(f"--prompts: choose from {choices} (comma separated), not {spec!r}")
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
            prompts = maker.round(tag, concurrency, mode)
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
