"""`halfmoon profile`: measure the engine on this machine and fit the conductor's cost model.

Runs an engine as an instance would (same dtype, threads and chunk size) over a grid of
(new prompt tokens, cached tokens) for prefill and (batch, context) for decode steps,
times a TCP transfer for the data plane, fits the model by least squares and writes it
where the conductor loads it (HALFMOON_HOME/costmodel.json by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from services.conductor.costmodel import (
    CostModel,
    decode_features,
    default_path,
    least_squares,
    prefill_features,
    profile_path,
)
from shared.engine import cpu
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model
from shared.model_store import ensure_model

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams = ONE) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0


def profile_prefill(
    engine: LLMEngine, rng: random.Random, quick: bool
) -> tuple[list[list[float]], list[float]]:
    rows, times = [], []
    news = (32, 256, 1024) if quick else (32, 128, 256, 512, 1024, 2048)
    cacheds = (0, 512) if quick else (0, 512, 1536)
    for cached in cacheds:
        for new in news:
            shared = _tokens(rng, cached)
            if cached:
                _run(engine, f"warm-{cached}-{new}", shared + _tokens(rng, 16))
            t = _run(engine, f"p-{cached}-{new}", shared + _tokens(rng, new))
            rows.append(prefill_features(new, cached))
            times.append(t)
    return rows, times


def profile_decode(
    engine: LLMEngine, rng: random.Random, quick: bool
) -> tuple[list[list[float]], list[float]]:
    rows, times = [], []
    for ctx in (256,) if quick else (128, 512, 1024):
        shared = _tokens(rng, ctx)
        _run(engine, f"dwarm-{ctx}", shared + [1])
        for batch in (1, 8, 32) if quick else (1, 4, 8, 16, 32, 64):
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            for i in range(batch):  # shared prefix: set-up is cheap, decode cost is not
                engine.add_request(f"d-{ctx}-{batch}-{i}", shared + [i + 2], params)
            while (
                any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running)
                or engine.scheduler.waiting
            ):
                engine.step()
            steps = []
            while engine.has_work():
                engine.step()
                st = engine.last_step
                if st.num_seqs == batch and st.num_tokens == batch:
                    steps.append(st.seconds)
            rows.append(decode_features(batch, ctx + 6))
            times.append(statistics.median(steps))
    return rows, times


async def profile_transfer(mib: int = 16) -> tuple[float, float]:
    """(latency s, bytes/s) of the TCP data plane on loopback."""
    from shared.transfer.tcp import TcpKVReceiver, TcpKVSender

    sender = TcpKVSender()
    await sender.start()
    try:
        receiver = TcpKVReceiver()
        small = []
        for i in range(5):
            h = sender.offer(f"s{i}", b"{}", b"x" * 4096, 1, 10)
            t0 = time.perf_counter()
            await receiver.fetch(h, 10)
            small.append(time.perf_counter() - t0)
        payload = bytes(mib << 20)
        big = []
        for i in range(3):
            h = sender.offer(f"b{i}", b"{}", payload, 1, 10)
            t0 = time.perf_counter()
            await receiver.fetch(h, 30)
            big.append(time.perf_counter() - t0)
    finally:
        await sender.close()
    latency = min(small)
    return latency, (mib << 20) / max(min(big) - latency, 1e-6)


def fit(args: argparse.Namespace) -> tuple[CostModel, dict[str, dict[str, float]]]:
    lm = load_model(ensure_model(args.model), args.dtype, "cpu", args.threads)
    engine = LLMEngine(
        lm,
        EngineConfig(
            kv_cache_bytes=int(args.kv_cache_gb * 2**30),
            max_num_batched_tokens=args.chunk_tokens,
            quantization=args.quantization,
        ),
    )
    dtype = str(lm.dtype).removeprefix("torch.")
    rng = random.Random(5)
    _run(engine, "warmup", _tokens(rng, 64))
    p_rows, p_times = profile_prefill(engine, rng, args.quick)
    d_rows, d_times = profile_decode(engine, rng, args.quick)
    latency, bandwidth = asyncio.run(profile_transfer())
    model = CostModel(
        prefill_coef=least_squares(p_rows, p_times),
        decode_coef=least_squares(d_rows, d_times),
        transfer_latency_s=latency,
        transfer_bytes_per_s=bandwidth,
        block_bytes=engine.kv.shape.block_nbytes,
        block_size=engine.config.block_size,
        num_layers=lm.num_layers,
        hidden_bytes_per_token=int(lm.config.hidden_size) * lm.dtype.itemsize,
        chunk_tokens=args.chunk_tokens,
        source=f"halfmoon profile: {lm.name} {dtype} {args.quantization}, "
        f"{args.threads} threads, "
        f"chunk {args.chunk_tokens}, {time.strftime('%Y-%m-%d %H:%M')}",
        key=cpu.engine_key(lm.name, dtype, args.quantization, torch.get_num_threads()),
    )
    errors = {
        "prefill": _errors(model.prefill_s, p_rows, p_times, lambda r: (r[1], r[3] / max(r[1], 1))),
        "decode": _errors(
            model.decode_step_s, d_rows, d_times, lambda r: (r[1], r[2] / max(r[1], 1))
        ),
    }
    return model, errors


def _errors(
    predict: Callable[[float, float], float],
    rows: list[list[float]],
    times: list[float],
    args_of: Callable[[list[float]], tuple[float, float]],
) -> dict[str, float]:
    rel = [abs(predict(*args_of(r)) - t) / t for r, t in zip(rows, times)]
    return {
        "median_rel_error": statistics.median(rel),
        "max_rel_error": max(rel),
        "points": len(rel),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="halfmoon profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto | float32 | bfloat16 (auto: bfloat16 where the CPU computes it natively)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="as each instance runs (halfmoon up: cores / instances)",
    )
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument(
        "--output",
        default="",
        help="where to write (default: HALFMOON_HOME/"
        "costmodels/<engine key>.json, which conductors pick for engines of that key, "
        f"and {default_path()})",
    )
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    model, errors = fit(args)
    outs = [Path(args.output)] if args.output else [profile_path(model.key), default_path()]
    for out in outs:
        model.save(out)
    print(
        json.dumps(
            {"written": [str(o) for o in outs], "model": model.__dict__, "fit": errors}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
