"""Pipelined prefill in placement (CPP): which groups of prefill instances `kvcentric`
weighs for a prompt (pure; policy.py's module docstring has the rule, pipeline.py the
times, shared/groups.py how a group's prefix is named in the KV index)."""

from __future__ import annotations

from services.conductor.pipeline import balanced_split, pipelined, prefill_end_s
from services.conductor.views import Candidate, RequestView, Snapshot
from shared.groups import group_members


def wants_group(snap: Snapshot, req: RequestView, single: Candidate) -> bool:
    """Groups are weighed for a prompt of at least pipeline_min_tokens, or one whose best
    single placement misses its TTFT SLO."""
    if snap.max_stages < 2:
        return False
    long = snap.pipeline_min_tokens > 0 and req.prompt_tokens >= snap.pipeline_min_tokens
    return long or single.ttft_s > req.ttft_slo_s * snap.slo_margin


def group_candidates(snap: Snapshot, req: RequestView) -> list[Candidate]:
    """Every group holding a prefix of the prompt whose stages are all idle, reusing it;
    and a cold group of each size from 2 to max_stages of the idle instances (smallest ids
    first), its layers split evenly."""
    # A colocated instance's cores decode its batch between prompts: never a stage.
    idle = sorted(
        p.instance_id
        for p in snap.prefills
        if p.queue_s <= 0.0 and p.instance_id not in snap.own_decodes
    )
    free = set(idle)
    out = []
    for holder, blocks in sorted(req.prefix_blocks.items()):
        stages = group_members(holder)
        if stages and len(stages) <= snap.max_stages and all(i in free for i, _ in stages):
            out.append(_group(snap, req, stages, blocks))
    for size in range(2, min(snap.max_stages, len(idle), snap.cost.num_layers) + 1):
        split = balanced_split(snap.cost.num_layers, size)
        out.append(_group(snap, req, list(zip(idle[:size], split)), 0))
    return out


def _group(
    snap: Snapshot, req: RequestView, stages: list[tuple[str, tuple[int, int]]], blocks: int
) -> Candidate:
    cached = min(blocks * snap.cost.block_size, req.prompt_tokens - 1)
    layers = [r for _, r in stages]
    times = pipelined(snap.cost, req.prompt_tokens - cached, cached, [0.0] * len(stages), layers)
    members = [i for i, _ in stages]
    return Candidate(
        members[0],
        blocks,
        "",
        0.0,
        0.0,
        prefill_end_s(times),
        snap.cost.overhead_s,
        tuple(zip(members, times)),
    )
