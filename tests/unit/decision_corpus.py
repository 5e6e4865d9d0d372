"""A seeded corpus of cluster states and requests, and the conductor's decision on each.

Each scenario is a registry fed with heartbeats (queues, batches, KV room, some instances
draining or silent), then a run of requests decided by one policy, each followed by the
dispatch accounting the live conductor does (handlers.Conductor._account) and now and
then a fresh heartbeat. What every decision says is written down in full: the placement,
the prefill candidate's predicted parts, decode, TBT, rejection, decode blocks and a
digest of the whole candidate list (the SQL record's `candidates`).

`tests/unit/data/decisions.jsonl` holds the decisions of the implementation before the
conductor's decision was made sublinear (issue #19); test_decision_corpus.py replays the
corpus through today's code and asserts every line is equal. To record again (only when a
decision is meant to change, and say why in the commit):

    python -m tests.unit.decision_corpus --record
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Iterator

from services.conductor import snapshot
from services.conductor.costmodel import CostModel
from services.conductor.policy import POLICIES, Candidate, Decision, Policy, RandomPolicy
from services.conductor.registry import Registry
from services.tools.sim.model import llama3_70b_8xa800
from shared.messages import GenerateRequest, InstanceInfo, Role, SamplingParams

GOLDEN = Path(__file__).parent / "data" / "decisions.jsonl"
EXPIRY_S = 3.0
# (prefill, decode) instance counts; the large ones are few, and see fewer requests.
SHAPES = [(1, 1), (2, 1), (3, 2), (4, 4), (7, 3), (16, 8), (33, 16), (64, 32)]
LARGE_SHAPES = [(256, 128), (1024, 512)]


def cost_model(rng: random.Random) -> CostModel:
    kind = rng.randrange(5)
    if kind == 0:
        return CostModel()
    if kind == 1:  # the simulator's large-model preset, 512-token blocks
        return llama3_70b_8xa800()
    if kind == 2:  # round numbers: many exact ties
        return CostModel(
            prefill_coef=[0.0, 1e-3, 0.0, 0.0],
            decode_coef=[0.01, 0.0 if rng.random() < 0.5 else 1e-3, 0.0],
            transfer_latency_s=0.0,
            transfer_bytes_per_s=1000.0,
            block_bytes=2,
            block_size=16,
            overhead_s=0.0,
        )
    # a calibrated-looking fit
    return CostModel(
        prefill_coef=[rng.uniform(0, 0.05), rng.uniform(1e-4, 3e-3), rng.uniform(0, 1e-6), 1e-6],
        decode_coef=[rng.uniform(0.005, 0.05), rng.uniform(0, 3e-3), rng.uniform(0, 3e-6)],
        transfer_latency_s=rng.choice([0.0, 5e-4]),
        transfer_bytes_per_s=rng.choice([1e6, 3.2e9]),
        overhead_s=rng.choice([0.0, 0.04]),
        block_bytes=368_640,
        block_size=16,
    )


def prefill_info(rng: random.Random, iid: str, now: float) -> InstanceInfo:
    idle = rng.random() < 0.35  # an empty queue: exactly 0 s, ties with the other idle ones
    prompts = [] if idle else [rng.randrange(1, 4096) for _ in range(rng.randrange(1, 5))]
    return InstanceInfo(
        instance_id=iid,
        role=Role.PREFILL,
        status="draining" if rng.random() < 0.04 else "ready",
        queue_depth=len(prompts),
        running=int(bool(prompts) and rng.random() < 0.5),
        queue_prompts=prompts,
        sent_at=now,
    )


def decode_info(rng: random.Random, iid: str, now: float) -> InstanceInfo:
    running = rng.choice([0, 0, rng.randrange(1, 8), rng.randrange(1, 96)])
    total = rng.choice([0, 0, 64, 4096])
    free = rng.randrange(total + 1) if total else 0
    return InstanceInfo(
        instance_id=iid,
        role=Role.DECODE,
        status="draining" if rng.random() < 0.04 else "ready",
        running=running,
        mean_context=float(rng.randrange(1, 9000)) if running else 0.0,
        kv_blocks_total=total,
        kv_blocks_free=free,
        kv_blocks_leased=rng.randrange(free + 1) if free and rng.random() < 0.3 else 0,
        sent_at=now,
    )


def ids(rng: random.Random, prefix: str, n: int) -> list[str]:
    """Instance ids in a shuffled first-seen order (the registry's order is not id order)."""
    out = [f"{prefix}-{i}" for i in range(n)]
    rng.shuffle(out)
    return out


def matches_for(rng: random.Random, prefills: list[str], blocks: int) -> dict[str, int]:
    kind = rng.randrange(6)
    if kind == 0 or not blocks:
        return {}
    if kind == 1:  # a prefix everyone holds (the system prompt), some hold more
        base = rng.randrange(1, blocks + 1)
        return {p: rng.choice([base, base, rng.randrange(base, blocks + 1)]) for p in prefills}
    held = rng.sample(prefills, k=rng.randrange(1, min(len(prefills), 9) + 1))
    if kind == 2:  # equal lengths: ties among holders
        n = rng.randrange(blocks + 1)
        out = {p: n for p in held}
    else:
        out = {p: rng.randrange(blocks + 1) for p in held}
    if rng.random() < 0.15:
        out["prefill-gone"] = rng.randrange(blocks + 1)  # an instance no longer alive
    return out


def request(rng: random.Random, bs: int, i: int) -> GenerateRequest:
    blocks = rng.choice([0, 1, 2, rng.randrange(3, 40), rng.randrange(40, 120)])
    prompt = max(1, blocks * bs + rng.randrange(bs))
    return GenerateRequest(
        request_id=f"r{i}",
        model="m",
        prompt_token_ids=[1] * prompt,
        sampling=SamplingParams(max_tokens=rng.choice([1, 16, 256, 2048])),
        arrival_time=0.0,
        ttft_slo_ms=rng.choice([0, 0, 0, 0, 50.0, 3000.0]),
        tbt_slo_ms=rng.choice([0, 0, 0, 0, 30.0, 100.0]),
    )


def account(reg: Registry, d: Decision, prompt_tokens: int) -> None:
    """What handlers.Conductor._account does after a dispatch."""
    assert d.prefill is not None
    reg.dispatched(d.prefill.instance_id, d.prefill.prefill_s, count=1)
    decode_id = d.decode_id or d.prefill.instance_id
    reg.dispatched(
        decode_id, tokens=prompt_tokens, count=1 if d.decode_id else 0, blocks=d.decode_blocks
    )


def candidate_row(c: Candidate) -> list[Any]:
    return [c.instance_id, c.prefix_blocks, c.pull_from, c.transfer_s, c.queue_s, c.prefill_s]


def digest(rows: list[Any]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:20]


def contenders(d: Decision, matches: dict[str, int]) -> list[Candidate]:
    """The candidates kvcentric reports (and the SQL record keeps): for each length of
    cached prefix an instance holds of its own (none included), the best instance holding
    that much (lowest TTFT, ties: the smaller id). Instances with the same own prefix reuse
    the same blocks, so only their queues differ, and no other can win. The baselines
    report every instance. Applied to the full list the earlier implementation made, this
    is the list the pruned decision makes."""
    if d.policy != "kvcentric":
        return d.candidates
    best: dict[int, Candidate] = {}
    for c in d.candidates:
        own = matches.get(c.instance_id, 0)
        if own not in best or (c.ttft_s, c.instance_id) < (best[own].ttft_s, best[own].instance_id):
            best[own] = c
    kept = {id(c) for c in best.values()}
    return [c for c in d.candidates if id(c) in kept]


def record(d: Decision, matches: dict[str, int]) -> list[Any]:
    """Everything a decision says (the SQL record's fields and the dispatched pull): the
    policy, the chosen candidate's parts, its TTFT, decode, TBT, the rejection, the decode
    blocks, and the number and a digest of the candidates it reports (contenders)."""
    p = d.prefill
    reported = contenders(d, matches)
    return [
        d.policy,
        None if p is None else [*candidate_row(p), p.overhead_s],
        d.ttft_s,
        d.decode_id,
        d.tbt_s if math.isfinite(d.tbt_s) else str(d.tbt_s),
        d.rejected,
        d.decode_blocks,
        len(reported),
        digest([candidate_row(c) for c in reported]),
    ]


def scenario(seed: int, policy_name: str, large: bool) -> Iterator[list[Any]]:
    rng = random.Random(seed)
    num_p, num_d = rng.choice(LARGE_SHAPES if large else SHAPES)
    cost = cost_model(rng)
    colocated = rng.random() < 0.15
    threshold = rng.choice([1.5, 1.5, 1.0, 3.0, math.inf])
    margin = rng.choice([1.0, 1.0, 0.8])
    reg = Registry(expiry_s=EXPIRY_S)
    prefills, decodes = ids(rng, "prefill", num_p), ids(rng, "decode", num_d)
    now = 100.0
    for iid in prefills:  # a few went silent long enough to be out
        reg.seen(prefill_info(rng, iid, now), now - (5.0 if rng.random() < 0.05 else 0.0))
    for iid in decodes:
        reg.seen(decode_info(rng, iid, now), now - (5.0 if rng.random() < 0.05 else 0.0))
    policy: Policy = RandomPolicy(seed) if policy_name == "random" else POLICIES[policy_name]()
    for i in range(6 if large else 10):
        now += rng.choice([0.0, 0.001, 0.05])
        if rng.random() < 0.3:  # a fresh heartbeat resets that instance's pending work
            iid = rng.choice(prefills + decodes)
            info = (prefill_info if iid.startswith("prefill") else decode_info)(rng, iid, now)
            reg.seen(info, now)
        req = request(rng, cost.block_size, i)
        blocks = len(req.prompt_token_ids) // cost.block_size
        matches = matches_for(rng, prefills, blocks)
        d = decide(reg, policy, cost, req, matches, now, threshold, margin, colocated)
        if d.prefill is not None and not d.rejected:
            account(reg, d, len(req.prompt_token_ids))
        yield [seed, i, *record(d, matches)]


def decide(
    reg: Registry,
    policy: Policy,
    cost: CostModel,
    req: GenerateRequest,
    matches: dict[str, int],
    now: float,
    threshold: float,
    margin: float,
    colocated: bool,
) -> Decision:
    """The live conductor's path from registry to decision (handlers.Conductor.place)."""
    prefills = reg.alive(Role.PREFILL, now)
    decodes = prefills if colocated else reg.alive(Role.DECODE, now)
    snap = snapshot.build(prefills, decodes, cost, threshold, margin, colocated)
    return policy.decide(snap, snapshot.request_view(req, matches, 30.0, 0.3))


def corpus() -> Iterator[list[Any]]:
    for name in sorted(POLICIES):
        for seed in range(30):
            yield from scenario(seed, name, large=False)
        for seed in range(1000, 1002):
            yield from scenario(seed, name, large=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--record", action="store_true", help=f"write {GOLDEN}")
    args = p.parse_args()
    lines = [json.dumps(r) for r in corpus()]
    if args.record:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} decisions{' recorded' if args.record else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
