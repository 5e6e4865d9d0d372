"""Replay a Mooncake trace through the real KV index and the engines' block pool
(shared/engine/block_manager.py, through services/kvmanager/pool.py).

One global pool of C blocks, requests in file order. For each request the hit is
prefix-continuous (leading hash_ids already cached, stopping at the first miss), weighted
by tokens (matched blocks x block_tokens, capped at the input length); then every block
of the request is touched or inserted. docs/design.md's reference figures use exactly this.

    halfmoon kv replay --trace FILE --capacity-blocks inf 100000 1000 [--policy lru|watermark|both]
    python -m services.kvmanager.replay ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import AbstractSet, Iterator, Sequence

from services.kvmanager.index import InstanceId, KVIndex, Tier
from services.kvmanager.pool import POLICIES, HashPool
from services.kvmanager.traces import TraceRequest, default_trace, is_conversation_trace, load_trace

DEFAULT_CAPACITIES: tuple[int | None, ...] = (None, 100_000, 50_000, 30_000, 10_000, 1_000)
# docs/design.md "Reference figures": plain LRU, one global pool, the whole conversation trace
# at its 512-token blocks (shown next to a replay of that trace only).
REFERENCE_LRU_HIT_PCT: dict[int | None, float] = {
    None: 37.4,
    100_000: 37.1,
    50_000: 36.2,
    30_000: 33.2,
    10_000: 21.5,
    1_000: 4.5,
}
_POOL = InstanceId("replay")  # the one instance the global pool is indexed under
_TIER: Tier = "dram"


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str
    capacity_blocks: int | None  # None = unlimited
    num_requests: int
    input_tokens: int
    hit_tokens: int
    hit_ratio: float  # token-weighted, 0..1
    num_requests_with_hit: int
    mean_request_hit_ratio: float  # unweighted mean of per-request ratios
    blocks_inserted: int
    blocks_evicted: int
    blocks_rejected: int
    peak_blocks: int
    avg_occupancy_blocks: float  # sampled after each request
    avg_occupancy_ratio: float | None  # of capacity; None when unlimited
    warm_occupancy_blocks: float | None  # mean after the first eviction; None if none
    elapsed_s: float


def kept_runs(
    hashes: Sequence[int], keep: AbstractSet[int]
) -> Iterator[tuple[int | None, list[int]]]:
    """Maximal runs of `hashes` that are in `keep`, each with the parent of its first block
    (how a request's fresh blocks enter the index; the simulator inserts them the same way)."""
    run: list[int] = []
    parent: int | None = None
    prev: int | None = None
    for h in hashes:
        if h in keep:
            if not run:
                parent = prev
            run.append(h)
        elif run:
            yield parent, run
            run = []
        prev = h
    if run:
        yield parent, run


class _Replayer:
    """Keeps the index in step with the pool, as the kvmanager does with instance events."""

    def __init__(self, pool: HashPool, block_tokens: int) -> None:
        self.pool, self.index, self.block_tokens = pool, KVIndex(), block_tokens
        self.hit_tokens = self.input_tokens = self.with_hit = self.inserted = self.rejected = 0
        self.sum_req_ratio = 0.0
        self.sum_occupancy = self.peak = 0
        # Occupancy once warm (from the first eviction on): what a watermark policy
        # really holds, and the capacity to give plain LRU for a fair comparison.
        self.sum_warm = self.num_warm = 0

    def step(self, req: TraceRequest) -> None:
        now = req.timestamp_ms / 1000.0
        per_tier = self.index.prefix_match(req.hash_ids).get(_POOL, {})
        matched = per_tier.get(_TIER, 0)
        hit = min(matched * self.block_tokens, req.input_length)
        self.hit_tokens += hit
        self.input_tokens += req.input_length
        self.with_hit += hit > 0
        self.sum_req_ratio += hit / req.input_length if req.input_length else 0.0
        self.index.touch(req.hash_ids[:matched], now)
        res = self.pool.admit(req.hash_ids, now)
        # Apply the net effect: a block may be inserted then evicted within one call.
        gone = [h for h in res.evicted if h not in self.pool]
        self.index.removed(_POOL, _TIER, gone)
        fresh = {h for h in res.inserted if h in self.pool}
        for parent, run in kept_runs(req.hash_ids, fresh):
            self.index.stored(_POOL, _TIER, run, 0, now, parent_of=parent)
        self.inserted += len(res.inserted)
        self.rejected += len(res.rejected)
        self.sum_occupancy += len(self.pool)
        self.peak = max(self.peak, len(self.pool))
        if self.pool.num_evicted:
            self.sum_warm += len(self.pool)
            self.num_warm += 1

    def check(self) -> None:
        held = self.index.usage(_POOL, _TIER).num_blocks
        if held != len(self.pool) or held != len(self.index):
            raise RuntimeError(f"index holds {held} blocks, pool {len(self.pool)}")


def replay_requests(
    requests: Sequence[TraceRequest],
    capacity_blocks: int | None,
    policy: str = "lru",
    block_tokens: int = 512,
    tail_first: bool | None = None,
) -> ReplayResult:
    started = time.perf_counter()
    r = _Replayer(HashPool(capacity_blocks, policy, tail_first), block_tokens)
    for req in requests:
        r.step(req)
    r.check()
    n = len(requests)
    avg_occ = r.sum_occupancy / n if n else 0.0
    return ReplayResult(
        policy=policy,
        capacity_blocks=capacity_blocks,
        num_requests=n,
        input_tokens=r.input_tokens,
        hit_tokens=r.hit_tokens,
        hit_ratio=r.hit_tokens / r.input_tokens if r.input_tokens else 0.0,
        num_requests_with_hit=r.with_hit,
        mean_request_hit_ratio=r.sum_req_ratio / n if n else 0.0,
        blocks_inserted=r.inserted,
        blocks_evicted=r.pool.num_evicted,
        blocks_rejected=r.rejected,
        peak_blocks=r.peak,
        avg_occupancy_blocks=avg_occ,
        avg_occupancy_ratio=avg_occ / capacity_blocks if capacity_blocks else None,
        warm_occupancy_blocks=r.sum_warm / r.num_warm if r.num_warm else None,
        elapsed_s=time.perf_counter() - started,
    )


def replay_trace(
    path: str,
    capacity_blocks: int | None,
    policy: str = "lru",
    block_tokens: int = 512,
    tail_first: bool | None = None,
    limit: int | None = None,
) -> ReplayResult:
    """Load and replay a trace; `elapsed_s` includes the load."""
    started = time.perf_counter()
    requests = load_trace(path, limit)
    result = replay_requests(requests, capacity_blocks, policy, block_tokens, tail_first)
    return ReplayResult(**{**asdict(result), "elapsed_s": time.perf_counter() - started})


# ---- CLI ------------------------------------------------------------------------------------


def parse_capacity(text: str) -> int | None:
    """A cache capacity flag (argparse type): a block count, or inf / unlimited / none for no
    limit (None). `halfmoon sim` takes its capacities with it too."""
    if text.lower() in ("inf", "unlimited", "none"):
        return None
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a block count or 'inf': {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"capacity must be >= 1 block, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon kv replay",
        description="Replay a Mooncake trace through the KV index and an eviction policy; "
        "report the prefix-continuous, token-weighted hit ratio.",
    )
    p.add_argument(
        "--trace",
        default=default_trace(),
        help="JSONL trace (default: env HALFMOON_TRACE, else the repository's 2%% "
        "sample of the conversation trace, %(default)s)",
    )
    p.add_argument(
        "--capacity-blocks",
        nargs="+",
        type=parse_capacity,
        metavar="C",
        default=list(DEFAULT_CAPACITIES),
        help="pool sizes in blocks, or inf/unlimited (default: the docs/design.md set)",
    )
    p.add_argument("--policy", choices=(*POLICIES, "both"), default="both")
    p.add_argument(
        "--tail-first",
        choices=("default", "on", "off"),
        default="default",
        help="evict chain tails before parents (default: off for lru, on for watermark)",
    )
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash block")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--compare-at-occupancy",
        action="store_true",
        help="also replay plain LRU with capacity = each watermark run's warm "
        "occupancy (docs/design.md: compare a watermark policy at what it holds)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per run")
    return p


@dataclass(frozen=True, slots=True)
class _Row:
    result: ReplayResult
    lru_at_occupancy: ReplayResult | None = None  # plain LRU sized to the warm occupancy


def reference_pct(result: ReplayResult, tail_first: str) -> float | None:
    """docs/design.md's figure for a plain-LRU row of the conversation trace (caller checks the
    trace); None for the other rows."""
    if result.policy != "lru" or tail_first == "on":
        return None
    return REFERENCE_LRU_HIT_PCT.get(result.capacity_blocks)


def _fmt_row(row: _Row, ref: str | None) -> str:
    """One row; `ref` is the reference cell, None when the table has no such column."""
    r = row.result
    cap = "inf" if r.capacity_blocks is None else str(r.capacity_blocks)
    warm = "-" if r.warm_occupancy_blocks is None else f"{r.warm_occupancy_blocks:.0f}"
    cmp = row.lru_at_occupancy
    return (
        f"{cap:>9} {r.policy:>9} {100 * r.hit_ratio:7.2f} "
        f"{'' if ref is None else f'{ref:>6} '}{r.blocks_evicted:8d} "
        f"{r.avg_occupancy_blocks:8.0f} {warm:>8} "
        f"{'-' if cmp is None else f'{100 * cmp.hit_ratio:.2f}':>8} {r.elapsed_s:7.2f}"
    )


def format_table(rows: Sequence[_Row], references: Sequence[float | None] | None = None) -> str:
    """The replay table; with `references` (one per row, None where none applies),
    docs/design.md's column beside the measured hit ratio."""
    ref_head = "" if references is None else f"{'ref %':>6} "
    head = (
        f"{'capacity':>9} {'policy':>9} {'hit %':>7} {ref_head}{'evicted':>8} "
        f"{'avg occ':>8} {'warm occ':>8} {'lru@occ%':>8} {'seconds':>7}"
    )
    cells: list[str | None] = (
        [None] * len(rows)
        if references is None
        else ["-" if ref is None else f"{ref:.1f}" for ref in references]
    )
    body = [_fmt_row(row, cell) for row, cell in zip(rows, cells)]
    return "\n".join([head, "-" * len(head), *body])


def _run_one(
    requests: Sequence[TraceRequest], capacity: int | None, policy: str, args: argparse.Namespace
) -> _Row:
    tail_first = {"default": None, "on": True, "off": False}[args.tail_first]
    result = replay_requests(requests, capacity, policy, args.block_tokens, tail_first)
    cmp = None
    if args.compare_at_occupancy and policy != "lru" and result.warm_occupancy_blocks:
        capacity = round(result.warm_occupancy_blocks)
        cmp = replay_requests(requests, capacity, "lru", args.block_tokens)
    return _Row(result, cmp)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        requests = load_trace(args.trace, args.limit)
    except OSError as exc:
        print(f"halfmoon kv replay: cannot read trace: {exc}", file=sys.stderr)
        return 2
    policies = POLICIES if args.policy == "both" else (args.policy,)
    rows = []
    for capacity in args.capacity_blocks:
        for policy in policies:
            row = _run_one(requests, capacity, policy, args)
            rows.append(row)
            if args.json:
                out = asdict(row.result)
                if row.lru_at_occupancy is not None:
                    out["lru_at_occupancy"] = asdict(row.lru_at_occupancy)
                print(json.dumps(out), flush=True)
    if not args.json:
        print(f"{args.trace}: {len(requests)} requests, {args.block_tokens}-token blocks")
        known = args.block_tokens == 512 and is_conversation_trace(requests)
        refs = [reference_pct(r.result, args.tail_first) for r in rows] if known else None
        print(format_table(rows, refs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
