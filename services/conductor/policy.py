"""Placement policies: pure functions over a snapshot of the cluster (no I/O, no clock),
so the live conductor and the simulator run the very same code.

Every policy returns a Decision with its candidates' predicted times, so an operator can
see why a request went where it went. The Decision is the whole decision: the prefix pull
(`Candidate.pull_from`, `prefix_blocks`, `transfer_s`) is in it, so the prediction, the
SQL record, the job dispatched and the simulator all see the same one; nothing adds a
pull afterwards.

`kvcentric` is Mooncake's Algorithm 1, and the only policy that pulls: for each prefill
instance, TTFT = transfer of a remote prefix (when the best holder has more than
`balancing_threshold` times its blocks) + queue time + predicted prefill time; the lowest
TTFT wins. The baselines (random, round_robin, least_loaded, largest_prefix) place with
their own rule and reuse only the chosen instance's own cache, as the paper's baselines
do. Every policy then picks decode by predicted TBT among the instances with room for the
request's KV, and rejects before any compute what misses its SLOs.

`kvcentric` also places a long prompt on a group of prefill instances that pipeline it
(CPP, pipeline.py), when the snapshot allows groups (`max_stages` > 1): for a prompt of
at least `pipeline_min_tokens`, or one no single instance can prefill within its TTFT SLO.
A group forms from idle instances only (no stage waits on another's queue while the
others hold their cores). Its stages keep the KV of their layers, so the index holds
that prefix under the group's holder id (`group_holder`: members and layer ranges); the
same group, all idle again, reuses it. No single instance pulls from a group. The lowest
predicted TTFT wins, group or single.
"""

from __future__ import annotations

import random
from dataclasses import replace

from services.conductor.groups import group_candidates, wants_group
from services.conductor.views import Candidate, Decision, InstanceView, RequestView, Snapshot
from shared.groups import GROUP


def best_holder(req: RequestView) -> tuple[str, int]:
    """The instance with the longest cached prefix another can pull (ties: the larger id,
    deterministically): its blocks in DRAM, since an export reads no disk tier. Groups do
    not count: a prefix split by layers is not pulled whole from one place."""
    disk = req.disk_blocks
    blocks, holder = max(
        (
            (b - disk.get(i, 0) if disk else b, i)
            for i, b in req.prefix_blocks.items()
            if not i.startswith(GROUP)
        ),
        default=(0, ""),
    )
    return holder, blocks


def own_prefix(snap: Snapshot, req: RequestView, inst_id: str) -> tuple[int, int, float, bool]:
    """(blocks reused, of its own those on its disk tier, the read's seconds, whether they
    are left there and computed) of `inst_id`'s own cached prefix. Its disk blocks are
    reused only when reading them back is quicker than computing them (Dynamo's router
    credits a block by its tier the same way)."""
    own = req.prefix_blocks.get(inst_id, 0)
    disk = min(req.disk_blocks.get(inst_id, 0), own) if req.disk_blocks else 0
    if not disk:
        return own, 0, 0.0, False
    cost, n = snap.cost, req.prompt_tokens

    def prefill_after(blocks: int) -> float:
        cached = min(blocks * cost.block_size, n - 1)
        return cost.prefill_s(n - cached, cached)

    read_s = cost.disk_load_s(disk)
    if read_s + prefill_after(own) <= prefill_after(own - disk):
        return own, disk, read_s, False
    return own - disk, disk, 0.0, True


def candidate(
    snap: Snapshot,
    req: RequestView,
    inst: InstanceView,
    pull: bool,
    holder: tuple[str, int] | None = None,
) -> Candidate:
    """Predicted TTFT parts on `inst`, with or without pulling the best holder's prefix
    (the pull's transfer time is part of the candidate's TTFT)."""
    bs = snap.cost.block_size
    own, disk, disk_s, skipped = own_prefix(snap, req, inst.instance_id)
    best_id, best = holder if holder is not None else best_holder(req)
    if pull and best > own and best_id:
        # The pulled prefix covers its own: no disk read (the engine imports over it).
        reuse, source, xfer = best, best_id, snap.cost.transfer_s(best - own)
        disk, disk_s, skipped = 0, 0.0, False
    else:
        reuse, source, xfer = own, "", 0.0
    cached = min(reuse * bs, req.prompt_tokens - 1)
    prefill = snap.cost.prefill_s(req.prompt_tokens - cached, cached)
    return Candidate(
        inst.instance_id,
        reuse,
        source,
        xfer,
        inst.queue_s,
        prefill,
        snap.cost.overhead_s,
        disk_blocks=disk,
        disk_s=disk_s,
        disk_skipped=skipped,
    )


def with_queue(c: Candidate, inst: InstanceView) -> Candidate:
    """`c`'s prediction for another instance with the same own prefix (and of it, the same
    blocks on disk): only its queue differs."""
    return Candidate(
        inst.instance_id, c.prefix_blocks, c.pull_from, c.transfer_s, inst.queue_s, c.prefill_s,
        c.overhead_s, disk_blocks=c.disk_blocks, disk_s=c.disk_s, disk_skipped=c.disk_skipped,
    )  # fmt: skip


def joined_tbt(snap: Snapshot, req: RequestView, d: InstanceView) -> float:
    """Predicted time between tokens on `d` once this request joins its batch."""
    ctx = (d.mean_context * d.running + req.prompt_tokens) / (d.running + 1)
    return snap.cost.decode_step_s(d.running + 1, ctx)


def kv_blocks_needed(snap: Snapshot, req: RequestView) -> int:
    """Decode blocks for the prompt and every token it may generate."""
    return -(-(req.prompt_tokens + req.max_tokens) // snap.cost.block_size)


def has_room(d: InstanceView, blocks: int) -> bool:
    return d.kv_blocks_free is None or d.kv_blocks_free >= blocks


def select_decode(snap: Snapshot, req: RequestView) -> tuple[str, float]:
    """The decode instance where the request is predicted to finish soonest, among those
    with room for its KV (ties: the smaller id): its handoff, of only the blocks past the
    prefix that instance caches (decode-side reuse), then every token at the time between
    tokens once it joins. With no prefix cached on any, that is the lowest TBT. Returns
    the instance and its TBT; ("", inf) when none has room. One pass, no sort: this runs
    over every decode instance per request."""
    need = kv_blocks_needed(snap, req)
    blocks = -(-req.prompt_tokens // snap.cost.block_size)
    tokens = max(1, req.max_tokens - 1)  # the first comes from prefill
    best_id, best_tbt, best_s = "", float("inf"), float("inf")
    for d in snap.decodes:
        if not has_room(d, need):
            continue
        tbt = joined_tbt(snap, req, d)
        held = min(req.decode_blocks.get(d.instance_id, 0), blocks - 1)
        finish_s = snap.cost.handoff_time_s(blocks - held) + tokens * tbt
        if finish_s < best_s or (finish_s == best_s and best_id and d.instance_id < best_id):
            best_id, best_tbt, best_s = d.instance_id, tbt, finish_s
    return best_id, best_tbt


def decodes_itself(snap: Snapshot, chosen: Candidate) -> bool:
    """Whether the chosen prefill keeps the request and decodes it: every instance in the
    colocated layout, a colocated one in a disaggregated pool. A pipelined group hands off
    to a decode instance whoever its first stage is."""
    return snap.colocated or (chosen.instance_id in snap.own_decodes and not chosen.stages)


def colocated_decode(snap: Snapshot, req: RequestView, chosen: Candidate) -> tuple[str, float]:
    """Colocated: the chosen instance decodes too, so its own batch sets the TBT; no decode
    instance is named (the job's empty decode id tells the instance to keep the request)."""
    own = snap.own_decodes.get(chosen.instance_id) or next(
        (d for d in snap.decodes if d.instance_id == chosen.instance_id),
        InstanceView(chosen.instance_id),
    )
    return "", joined_tbt(snap, req, own)


def finish(
    policy: str, snap: Snapshot, req: RequestView, chosen: Candidate, candidates: list[Candidate]
) -> Decision:
    """Pick decode, then apply the SLOs: early rejection shared by every policy."""
    itself = decodes_itself(snap, chosen)
    decode_id, tbt = colocated_decode(snap, req, chosen) if itself else select_decode(snap, req)
    d = Decision(
        policy,
        chosen,
        decode_id,
        tbt,
        candidates,
        decode_blocks=0 if itself else kv_blocks_needed(snap, req),
    )
    if not decode_id and not itself:
        d.rejected = (
            "no decode instance"
            if not snap.decodes
            else f"no decode instance with room for {d.decode_blocks} KV blocks"
        )
    elif chosen.ttft_s > req.ttft_slo_s * snap.slo_margin:
        d.rejected = (
            f"predicted TTFT {chosen.ttft_s:.2f}s exceeds {_share(snap)}the SLO of "
            f"{req.ttft_slo_s:.2f}s"
        )
    elif tbt > req.tbt_slo_s * snap.slo_margin:
        d.rejected = (
            f"predicted TBT {tbt * 1e3:.0f}ms exceeds {_share(snap)}the SLO of "
            f"{req.tbt_slo_s * 1e3:.0f}ms"
        )
    return d


def follow(policy: str, snap: Snapshot, req: RequestView, leader: str) -> Decision | None:
    """A later sample of a prompt whose first sample went to prefill instance `leader`
    (n > 1): placed there too, whatever the policy. That engine holds a sequence whose
    prompt another is still computing and then starts it from the cached blocks
    (scheduler.py), so the prompt is computed once: one prefill, n decodes. Elsewhere the
    sample would compute it again, which is why no policy's own rule may place it.

    The whole prompt counts as held there (the first sample is computing it), so the
    prediction is that instance's queue, which includes the first sample's prefill, plus
    the last token: the first sample's TTFT. Decode and the SLOs are decided as for any
    request, so the samples may spread over decode instances. None when there is no
    `leader` or it is not in the snapshot (it died or refused): the policy decides."""
    inst = next((p for p in snap.prefills if p.instance_id == leader), None) if leader else None
    if inst is None:
        return None
    whole = {**req.prefix_blocks, leader: req.prompt_tokens // snap.cost.block_size}
    held = replace(req, prefix_blocks=whole)
    chosen = candidate(snap, held, inst, pull=False)
    return finish(policy, snap, held, chosen, [chosen])


def _share(snap: Snapshot) -> str:
    return "" if snap.slo_margin >= 1 else f"{snap.slo_margin:.0%} of "


class Policy:
    """A baseline: `choose` picks among candidates that all use their own cache only (no
    pull: the baselines compare placement rules, as the paper's do)."""

    name = "base"

    def decide(self, snap: Snapshot, req: RequestView) -> Decision:
        if not snap.prefills:
            return Decision(self.name, rejected="no prefill instance")
        best = best_holder(req)
        # Instances with the same own prefix (and of it on disk) share one prediction;
        # only queues differ.
        shared: dict[tuple[int, int], Candidate] = {}
        cands = []
        for p in snap.prefills:
            own = _own_key(req, p.instance_id)
            c = shared.get(own)
            if c is None:
                c = shared[own] = candidate(snap, req, p, False, best)
                cands.append(c)
            else:
                cands.append(with_queue(c, p))
        return finish(self.name, snap, req, self.choose(snap, req, cands), cands)

    def choose(self, snap: Snapshot, req: RequestView, cands: list[Candidate]) -> Candidate:
        raise NotImplementedError


class RandomPolicy(Policy):
    """Any instance, seeded. Never pulls a prefix."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, snap: Snapshot, req: RequestView, cands: list[Candidate]) -> Candidate:
        return self.rng.choice(cands)


class RoundRobinPolicy(Policy):
    """Each instance in turn, by id. Never pulls a prefix."""

    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, snap: Snapshot, req: RequestView, cands: list[Candidate]) -> Candidate:
        ordered = sorted(cands, key=lambda c: c.instance_id)
        chosen = ordered[self.next % len(ordered)]
        self.next += 1
        return chosen


class LeastLoadedPolicy(Policy):
    """Shortest predicted queue; ties by id. Ignores the cache and never pulls a prefix
    (the paper's load-balancing baseline)."""

    name = "least_loaded"

    def choose(self, snap: Snapshot, req: RequestView, cands: list[Candidate]) -> Candidate:
        return min(cands, key=lambda c: (c.queue_s, c.instance_id))


class LargestPrefixPolicy(Policy):
    """Most cached prefix blocks on the instance itself; ties: queue. Never pulls a prefix
    (local cache-aware: the paper's baseline for global cache-aware kvcentric)."""

    name = "largest_prefix"

    def choose(self, snap: Snapshot, req: RequestView, cands: list[Candidate]) -> Candidate:
        return min(cands, key=lambda c: (-c.prefix_blocks, c.queue_s, c.instance_id))


def _own_key(req: RequestView, instance_id: str) -> tuple[int, int]:
    """What an instance's prediction depends on besides its queue: its own cached prefix,
    and of it, the blocks on its disk tier."""
    disk = req.disk_blocks.get(instance_id, 0) if req.disk_blocks else 0
    return req.prefix_blocks.get(instance_id, 0), disk


def pulls(snap: Snapshot, own_blocks: int, best_blocks: int) -> bool:
    """Algorithm 1's cache load balancing: pull when best_len / prefix_len > threshold
    (an instance with nothing cached counts as 1 block: at the default 1.5, 2 remote
    blocks qualify)."""
    return best_blocks > own_blocks and best_blocks / max(own_blocks, 1) > snap.balancing_threshold


class KVCentricPolicy(Policy):
    """Algorithm 1: lowest predicted TTFT, each candidate pulling the best holder's prefix
    when that is more than `balancing_threshold` times its own (`pulls`)."""

    name = "kvcentric"

    def decide(self, snap: Snapshot, req: RequestView) -> Decision:
        if not snap.prefills:
            return Decision(self.name, rejected="no prefill instance")
        holder = best_holder(req)
        cands = self.contenders(snap, req, holder)
        chosen = min(cands, key=lambda c: (c.ttft_s, c.instance_id))
        if wants_group(snap, req, chosen):
            groups = group_candidates(snap, req)
            if groups:
                cands = cands + groups
                chosen = min(cands, key=lambda c: (c.ttft_s, c.instance_id))
        return finish(self.name, snap, req, chosen, cands)

    @staticmethod
    def contenders(snap: Snapshot, req: RequestView, holder: tuple[str, int]) -> list[Candidate]:
        """The candidates that can win, in snapshot order: for each length of cached
        prefix an instance holds of its own (none included), the best instance holding
        that much (lowest TTFT, ties: the smaller id). Instances with the same own prefix
        reuse the same blocks (their own, or the best holder's pulled), so their transfer
        and prefill are one prediction and only their queues differ: the cost model runs
        once per prefix length, not once per instance."""
        # (own prefix length, of it on disk) -> (that prediction, its transfer + disk read
        # + overhead, best so far: (TTFT, id, snapshot position, view))
        Group = tuple[Candidate, float, tuple[float, str, int, InstanceView]]
        groups: dict[tuple[int, int], Group] = {}
        for i, p in enumerate(snap.prefills):
            own = _own_key(req, p.instance_id)
            group = groups.get(own)
            if group is None:
                c = candidate(snap, req, p, pulls(snap, own[0], holder[1]), holder)
                # TTFT summed as Candidate.ttft_s sums it
                fixed = c.overhead_s + c.transfer_s + c.disk_s
                groups[own] = (c, fixed, (c.ttft_s, p.instance_id, i, p))
                continue
            c, fixed, best = group
            ttft = fixed + p.queue_s + c.prefill_s
            if ttft < best[0] or (ttft == best[0] and p.instance_id < best[1]):
                groups[own] = (c, fixed, (ttft, p.instance_id, i, p))
        chosen = sorted((best[2], c, best[3]) for c, _, best in groups.values())
        return [c if c.instance_id == p.instance_id else with_queue(c, p) for _, c, p in chosen]


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        RandomPolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
        LargestPrefixPolicy,
        KVCentricPolicy,
    )
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
