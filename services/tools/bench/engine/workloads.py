"""The engine's workloads: each returns plain figures (seconds, tokens, contexts)."""

from __future__ import annotations

import random
import time
from typing import Any

from shared.engine.llm_engine import LLMEngine
from shared.engine.params import SamplingParams
from shared.stats import percentile


def prompts(n: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def run(engine: LLMEngine, batch: list[list[int]], new_tokens: int, tag: str) -> dict[str, Any]:
    """Submit all at once and step to the end. Per-token timestamps give TBT; pure decode
    steps (every scheduled sequence one token) give the decode rate, and each such step
    with every sequence running keeps its contexts for the roofline."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}{i}", p, params)
    stamps: dict[str, list[float]] = {}
    decode_s, decode_tokens = 0.0, 0
    full_steps: list[tuple[float, list[int]]] = []  # (seconds, contexts) at full batch
    t0 = time.perf_counter()
    while engine.has_work():
        contexts = [s.num_tokens for s in engine.scheduler.running]
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            stamps.setdefault(out.request_id, []).append(now)
        st = engine.last_step
        if st.num_tokens == st.num_seqs and st.num_seqs:
            decode_s += st.seconds
            decode_tokens += st.num_seqs
            if st.num_seqs == len(batch) and len(contexts) == len(batch):
                full_steps.append((st.seconds, contexts))
    wall = time.perf_counter() - t0
    gaps = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    total = sum(len(ts) for ts in stamps.values())
    steps = sorted(full_steps)
    mid = steps[len(steps) // 2] if steps else (float("nan"), [])
    return {
        "requests": len(batch),
        "output_tokens": total,
        "wall_s": wall,
        "end_to_end_tok_s": total / wall,
        "decode_tok_s": decode_tokens / decode_s if decode_s else float("nan"),
        "tbt_p50_ms": percentile(gaps, 50) * 1e3,
        "tbt_p99_ms": percentile(gaps, 99) * 1e3,
        "full_step_p50_ms": mid[0] * 1e3,
        "full_step_contexts": mid[1],
    }


def single_stream(
    engine: LLMEngine, batch: list[list[int]], new_tokens: int, tag: str
) -> dict[str, Any]:
    """One request at a time; every decode step is a full (one-sequence) step."""
    runs = [run(engine, [p], new_tokens, f"{tag}{i}-") for i, p in enumerate(batch)]
    steps = sorted((r["full_step_p50_ms"], r["full_step_contexts"]) for r in runs)
    step_ms, contexts = steps[len(steps) // 2]
    decode_tok_s = sum(r["decode_tok_s"] for r in runs) / len(runs)
    return {
        "requests": len(batch),
        "step_p50_ms": step_ms,
        "contexts": contexts,
        "decode_tok_s": decode_tok_s,
        "tbt_p50_ms": percentile([r["tbt_p50_ms"] for r in runs], 50),
    }


def prefix_reuse(engine: LLMEngine, vocab: int, seed: int = 7) -> dict[str, float]:
    """TTFT of a 2,048-token prompt whose first 1,792 tokens are cached, against cold
    (another seed: other prompts, none of them cached by an earlier call)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(1792)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(rid: str, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, params)
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t0

    tail = lambda: [rng.randrange(100, vocab) for _ in range(256)]  # noqa: E731
    cold = ttft("cold", shared + tail())  # also caches the shared part
    cold2 = ttft("cold2", [t + 1 for t in shared] + tail())  # nothing cached: a second cold
    warm = min(ttft(f"warm{i}", shared + tail()) for i in range(3))
    return {
        "cold_ttft_ms": min(cold, cold2) * 1e3,
        "warm_ttft_ms": warm * 1e3,
        "ratio": warm / min(cold, cold2),
    }


def prefill(engine: LLMEngine, vocab: int, tokens: int = 2048) -> float:
    """Seconds to prefill `tokens` fresh tokens (best of two)."""
    best = float("inf")
    for i in range(2):
        prompt = prompts(1, tokens, tokens, 11 + i, vocab)[0]
        engine.add_request(
            f"prefill{i}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        )
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        best = min(best, time.perf_counter() - t0)
    return best
