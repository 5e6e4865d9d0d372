"""`halfmoon bench kv`: the KV manager's prefix-match query latency.

The index holds 64 instances (flag), each with a random-length share of a 256-block
prompt's chain in DRAM and/or disk, plus unrelated chains as background; the query is
the full 256-block prompt. Target: under 1 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Sequence

from services.kvmanager.index import KVIndex
from shared.stats import percentile


def build(instances: int, blocks: int, background: int, seed: int) -> tuple[KVIndex, list[int]]:
    rng = random.Random(seed)
    ix = KVIndex()
    chain = [rng.getrandbits(64) for _ in range(blocks)]
    for i in range(instances):
        name = f"prefill-{i}"
        ix.stored(name, "dram", chain[: rng.randrange(blocks + 1)], 368_640, now=0)
        ix.stored(name, "disk", chain[: rng.randrange(blocks + 1)], 368_640, now=0)
        for _ in range(background // instances):
            ix.stored(name, "dram", [rng.getrandbits(64) for _ in range(32)], 368_640, now=0)
    return ix, chain


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench kv", description=__doc__)
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--background-chains", type=int, default=6400)
    p.add_argument("--queries", type=int, default=2000)
    args = p.parse_args(argv)
    ix, chain = build(args.instances, args.blocks, args.background_chains, seed=3)
    times = []
    for _ in range(args.queries):
        t0 = time.perf_counter()
        ix.prefix_match(chain)
        times.append(time.perf_counter() - t0)
    result = {
        "instances": args.instances,
        "prompt_blocks": args.blocks,
        "indexed_blocks": len(ix),
        "queries": args.queries,
        "prefix_match_p50_ms": percentile(times, 50) * 1e3,
        "prefix_match_p99_ms": percentile(times, 99) * 1e3,
        "target_ms": 1.0,
    }
    print(json.dumps(result, indent=2))
    print(
        f"prefix match, {args.blocks}-block prompt over {args.instances} instances "
        f"({len(ix)} blocks indexed): p50 {result['prefix_match_p50_ms']:.3f} ms, "
        f"p99 {result['prefix_match_p99_ms']:.3f} ms (target < 1 ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
