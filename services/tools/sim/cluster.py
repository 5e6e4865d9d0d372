"""The simulated cluster: N prefill and M decode instances under one policy, and its events.

Placement is the live conductor's code: the KV index's prefix match per instance
(`KVIndex.match(hash_ids).per_instance`), a Snapshot of the instances, `policy.decide`,
and its early rejection. Pools are the engines' block pool (shared/engine/block_manager.py,
through services/kvmanager/pool.py); every admit is mirrored into the index (stored /
removed), as the KV manager does from the instances' events.

Events: arrivals come straight from the (time-ordered) trace; prefill completions and
KV arrivals at decode sit on one heap. At equal times heap events go first, so a request
arriving just as another finishes sees its blocks. Decode steps are not events: each
decode instance is advanced lazily to the time it is looked at (see model.DecodeInstance).

With `cores` set (the instances share that many cores, model.Cores), prefill jobs and
decode steps end when the shared cores say so: those completions come from the Cores,
interleaved with the heap's events in time order (completions first at equal times).
"""

from __future__ import annotations

import heapq
import math
import random
from typing import Sequence, cast

from services.conductor.pipeline import balanced_split, chunk_sizes, chunk_work, pipelined
from services.conductor.policy import Policy
from services.conductor.replication import Copy, Replicator
from services.conductor.views import Candidate, RequestView, Snapshot
from services.kvmanager.heat import PrefixHeat
from services.kvmanager.index import KVIndex
from services.kvmanager.pool import HashPool
from services.kvmanager.replay import kept_runs
from services.prefill.streaming import streams
from services.tools.sim.config import SimConfig
from services.tools.sim.cores import BACKGROUND, Cores
from services.tools.sim.decode import DecodeInstance
from services.tools.sim.handoff import after_prefill_s, tail_blocks
from services.tools.sim.model import Outcome, SimRequest
from services.tools.sim.prefill import ChunkedPrefillInstance, PrefillInstance, PrefillJob
from shared.groups import group_holder

_TIER = "dram"
_PREFILL_DONE, _KV_ARRIVED, _COPY_LANDED = 0, 1, 2


class Cluster:
    """The simulated instances, the index, the event heap and the outcomes."""

    def __init__(self, cfg: SimConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        self.cost = cfg.cost  # what the policy predicts with
        self.work = cfg.work_cost or cfg.cost  # what the instances' work takes
        self.cores = (
            Cores(cfg.cores, cfg.background_weight, cfg.background_cap) if cfg.cores else None
        )
        self.rng = random.Random(cfg.seed)
        self.index = KVIndex()
        self.prefills: dict[str, PrefillInstance | ChunkedPrefillInstance] = {}
        self.decodes: dict[str, DecodeInstance] = {}
        self._make_instances()
        # What placement sees: every instance here; the elastic cluster (elastic.py) keeps
        # only those serving the role now, and hides the others' caches from the index.
        self.live_prefills = list(self.prefills.values())
        self.live_decodes = list(self.decodes.values())
        self.hidden: set[str] = set()
        self.matched_blocks = 0  # the last arrival's longest cached prefix, in blocks
        # Prefixes held by groups, split by layers among their stages: one pool per group
        # holder id (shared/groups.py), mirrored into the index under that id. (They
        # do not compete with their members' own pools for memory: a simplification.)
        self.group_pools: dict[str, HashPool] = {}
        self.events: list[tuple[float, int, int, str, Outcome | None]] = []
        self.outcomes: list[Outcome] = []
        self.num_placed_over_slo = 0  # rejected by the policy but placed (reject=False)
        self.handoff_held_blocks = 0  # prompt blocks decode held already (decode_reuse)
        # Hot-prefix replication: the KV manager's heat, the conductor's plan, the copies
        # ordered (by number: the heap's tie-breaker) and those that found no source.
        self.heat = PrefixHeat(cfg.heat_half_life_s)
        self.replicator = Replicator(cfg.replication) if cfg.replication else None
        self.copies: list[Copy] = []
        self.copies_failed = 0

    def _make_instances(self) -> None:
        cfg = self.cfg
        for i in range(cfg.num_prefill):
            self.prefills[f"p{i:02d}"] = self._prefill(f"p{i:02d}")
        for i in range(cfg.num_decode):
            self.decodes[f"d{i:02d}"] = self._decode(f"d{i:02d}")

    def _decode(self, instance_id: str) -> DecodeInstance:
        pool = HashPool(self.cfg.cache_blocks, self.cfg.eviction)
        return DecodeInstance(instance_id, self.work, self.cores, pool)

    def _prefill(self, instance_id: str) -> PrefillInstance | ChunkedPrefillInstance:
        pool = HashPool(self.cfg.cache_blocks, self.cfg.eviction)
        if self.cfg.prefill_chunk_tokens:
            return ChunkedPrefillInstance(
                instance_id, pool, self.cfg.prefill_chunk_tokens, self.work, cores=self.cores
            )
        return PrefillInstance(instance_id, pool, cores=self.cores)

    def _pool(self, instance_id: str) -> HashPool | None:
        inst = self.prefills.get(instance_id)
        return inst.pool if inst is not None else None

    # ---- placement ------------------------------------------------------------------------

    def arrive(self, req: SimRequest) -> None:
        now = req.arrival_s
        if self.cores is not None:
            self.cores.add_background(now, self.cfg.background_s_per_request)
        for d in self.decodes.values():
            d.advance(now)
        matches = self.index.match(req.hash_ids).per_instance
        if self.hidden:
            matches = {i: b for i, b in matches.items() if i not in self.hidden}
        self.matched_blocks = max(matches.values(), default=0)
        hits = req.hash_ids[: self.matched_blocks]  # as the KV manager counts them
        self.heat.hit(hits, now)
        hot = self.heat.hot_run(hits, now, self.cfg.hot_rps)
        snap = Snapshot(
            [p.view(now) for p in self.live_prefills],
            [d.view() for d in self.live_decodes],
            self.cost,
            self.cfg.balancing_threshold,
            self.cfg.slo_margin,
            max_stages=self.cfg.max_stages,
            pipeline_min_tokens=self.cfg.pipeline_min_tokens,
        )
        view = RequestView(
            str(req.index),
            req.input_length,
            cast("dict[str, int]", dict(matches)),  # InstanceId is a str
            self.cfg.ttft_slo_s,
            self.cfg.tbt_slo_s,
            req.output_length,
            decode_blocks=self._decode_blocks(req.hash_ids),
            hot_blocks=hot[0],
            heat_rps=hot[1],
        )
        decision = self.policy.decide(snap, view)
        out = Outcome(req, predicted_ttft_s=decision.ttft_s)
        self.outcomes.append(out)
        if decision.rejected and (
            self.cfg.reject or decision.prefill is None or not decision.decode_id
        ):
            out.rejected = decision.rejected
            return
        self.num_placed_over_slo += bool(decision.rejected)
        chosen = decision.prefill  # its pull (if any) is the policy's, as in the live conductor
        assert chosen is not None
        out.prefill_id, out.decode_id = chosen.instance_id, decision.decode_id
        self.decodes[out.decode_id].assign(req.input_length + 1)
        if chosen.stages:
            self._start_group(out, chosen, now)
            return
        inst = self.prefills[chosen.instance_id]
        inst.enqueue(
            PrefillJob(
                out, chosen.pull_from, chosen.prefix_blocks, chosen.transfer_s + chosen.prefill_s
            )
        )
        self._start(inst, now)
        self._replicate(snap, view, req.hash_ids, now)

    def _replicate(self, snap: Snapshot, view: RequestView, hashes: list[int], now: float) -> None:
        """After a placement, as the live conductor: the copy the hot prefix needs, landing
        on its target once its transfer is done (prefill/prefix_pull.py's replicate)."""
        copy = self.replicator.plan(snap, view, hashes, now) if self.replicator else None
        if copy is None:
            return
        self.copies.append(copy)
        landed = now + self.work.transfer_s(copy.blocks)
        heapq.heappush(self.events, (landed, _COPY_LANDED, len(self.copies) - 1, copy.target, None))

    def _land(self, copy: Copy, now: float) -> None:
        """A copy arrives: its blocks join the target's pool as replicas, unless the source
        evicted them meanwhile (the live export then fails, and nothing lands)."""
        hashes = list(copy.block_hashes)
        if self.prefills[copy.source].pool.prefix_blocks(hashes) < len(hashes):
            self.copies_failed += 1
            return
        self._admit_to(copy.target, self.prefills[copy.target].pool, hashes, now, replica=True)

    def _start_group(self, out: Outcome, chosen: Candidate, now: float) -> None:
        """Each stage holds its (idle) instance until its part of the flow shop ends, as
        the conductor predicted it but with the work cost; the last stage's end is the
        first token. What the group reuses is what its pool holds now."""
        req = out.request
        layers = [t.layers for _, t in chosen.stages]
        holder = group_holder([(i, t.layers) for i, t in chosen.stages])
        pool = self.group_pools.get(holder)
        reuse = pool.prefix_blocks(req.hash_ids) if pool is not None else 0
        cached = min(reuse * self.cfg.block_tokens, req.input_length - 1)
        times = pipelined(self.work, req.input_length - cached, cached, [0.0] * len(layers), layers)
        out.stages, out.reused_blocks, out.prefill_start_s = len(layers), reuse, now
        for k, ((instance_id, _), t) in enumerate(zip(chosen.stages, times)):
            inst = self.prefills[instance_id]
            assert isinstance(inst, PrefillInstance)  # SimConfig allows groups only so
            last = k == len(layers) - 1
            job = PrefillJob(out, "", 0, t.end_s, stage=k, last=last, group=holder)
            inst.run_stage(job, now, now + t.end_s)
            self._push(now + t.end_s, _PREFILL_DONE, instance_id, None)

    def _start(self, inst: PrefillInstance | ChunkedPrefillInstance, now: float) -> None:
        if not inst.start_next(now, self.work, self.cfg.block_tokens, self._pool):
            return
        if self.cores is None:
            self._push(inst.running_end_s, _PREFILL_DONE, inst.instance_id, None)
        else:
            self.cores.begin(inst.instance_id, now, inst.running_end_s - now)

    # ---- events ---------------------------------------------------------------------------

    def _push(self, t: float, kind: int, where: str, out: Outcome | None) -> None:
        # The trace index breaks ties deterministically; kind orders completions first.
        seq = out.request.index if out is not None else -1
        heapq.heappush(self.events, (t, kind, seq, where, out))

    def run_until(self, t: float) -> None:
        """Handle every event at or before `t`."""
        events = self.events
        while True:
            done = self.cores.next_done() if self.cores is not None else None
            if done is not None and done[0] <= t and (not events or done[0] <= events[0][0]):
                self._shared_done(*done)
            elif events and events[0][0] <= t:
                when, kind, seq, where, out = heapq.heappop(events)
                if kind == _PREFILL_DONE:
                    self._prefill_done(self.prefills[where], when)
                elif kind == _COPY_LANDED:
                    self._land(self.copies[seq], when)
                else:
                    assert out is not None
                    dec = self.decodes[where]
                    dec.advance(when)
                    dec.arrive(out, when)
            else:
                return

    def _shared_done(self, now: float, instance_id: str) -> None:
        """A prefill job or decode step on the shared cores is done (or the background
        ran dry, which changes the instances' rates)."""
        assert self.cores is not None
        if instance_id == BACKGROUND:
            self.cores.settle(now)
        elif instance_id in self.prefills:
            self.cores.end(instance_id, now)
            self._prefill_done(self.prefills[instance_id], now)
        else:
            self.decodes[instance_id].end_shared_step(now)

    def _prefill_done(self, inst: PrefillInstance | ChunkedPrefillInstance, now: float) -> None:
        for job in inst.finish_running():
            if not job.last:
                continue  # a stage before the last: it only frees its instance
            out, req = job.outcome, job.outcome.request
            if job.group:
                pool = self.group_pools.get(job.group)
                if pool is None:
                    pool = HashPool(self.cfg.cache_blocks, self.cfg.eviction)
                    self.group_pools[job.group] = pool
                self._admit_to(job.group, pool, req.hash_ids, now)
            else:
                self._admit(inst, req.hash_ids, now)
            out.prefill_end_s = now
            out.ttft_s = now - req.arrival_s + self.cost.overhead_s
            if req.output_length <= 1:  # the prefill's token was the whole answer
                out.finish_s = now
                self.decodes[out.decode_id].unassign(req.input_length + 1)
            else:
                self._push(now + self._handoff_s(out, now), _KV_ARRIVED, out.decode_id, out)
        self._start(inst, now)

    def _handoff_s(self, out: Outcome, now: float) -> float:
        """The first token to the KV in place on decode (handoff.py)."""
        req, bt = out.request, self.cfg.block_tokens
        share = 1.0
        if out.stages:  # each stage sends its layers' slice; the largest share is slowest
            layers = self.work.num_layers
            share = max(b - a for a, b in balanced_split(layers, out.stages)) / layers
        q = self.rng.random()
        chunk = self.work.chunk_tokens
        blocks = len(req.hash_ids) - self._decode_held(out)
        if not (self.cfg.streamed_handoff and streams(req.input_length, req.output_length, chunk)):
            return after_prefill_s(self.work, blocks, q, share=share)
        cached = out.reused_blocks * bt
        new = max(1, req.input_length - cached)
        first_chunk_s = chunk_work(self.work, new, cached)[0] * share
        tail = min(blocks, tail_blocks(req.input_length, chunk_sizes(new, chunk)[-1], bt))
        overlap = max(0.0, now - out.prefill_start_s - first_chunk_s)
        return after_prefill_s(self.work, blocks, q, share=share, tail=tail, overlap_s=overlap)

    def _decode_blocks(self, hashes: list[int]) -> dict[str, int]:
        """What placement sees of the decode instances' caches (decode-side reuse)."""
        if not self.cfg.decode_reuse:
            return {}
        pools = ((d.instance_id, d.pool) for d in self.live_decodes if d.pool is not None)
        return {i: n for i, pool in pools if (n := pool.prefix_blocks(hashes))}

    def _decode_held(self, out: Outcome) -> int:
        """Decode-side reuse: the prompt's leading blocks its decode instance caches, which
        do not move (one block always does, as live)."""
        pool = self.decodes[out.decode_id].pool
        hashes = out.request.hash_ids
        if not self.cfg.decode_reuse or pool is None or not hashes:
            return 0
        held = min(pool.prefix_blocks(hashes), len(hashes) - 1)
        self.handoff_held_blocks += held
        return held

    def _admit(
        self, inst: PrefillInstance | ChunkedPrefillInstance, hashes: list[int], now: float
    ) -> None:
        """Store the prompt's blocks (own, pulled and new) in the pool; mirror the net
        change into the index (a block may be inserted then evicted in one admit)."""
        self._admit_to(inst.instance_id, inst.pool, hashes, now)

    def _admit_to(
        self, holder: str, pool: HashPool, hashes: list[int], now: float, replica: bool = False
    ) -> None:
        res = pool.admit(hashes, now, replica)
        gone = [h for h in res.evicted if h not in pool]
        if gone:
            self.index.removed(holder, _TIER, gone)
        fresh = {h for h in res.inserted if h in pool}
        if fresh:
            for parent, run in kept_runs(hashes, fresh):
                self.index.stored(holder, _TIER, run, 0, now, parent_of=parent)

    def prewarm(self, hashes: list[int], now: float) -> None:
        """Cache `hashes` on every prefill instance before the first request."""
        for inst in self.prefills.values():
            self._admit(inst, hashes, now)

    def drain(self) -> None:
        self.run_until(math.inf)
        for d in self.decodes.values():
            d.advance(math.inf)
        if any(d.busy or d.assigned or d.waiting for d in self.decodes.values()):
            raise RuntimeError("decode instances still hold work after the drain")


def common_prefix(requests: Sequence[SimRequest]) -> list[int]:
    """The leading blocks that every request starts with."""
    if not requests:
        return []
    prefix = list(requests[0].hash_ids)
    for req in requests:
        n = 0
        for a, b in zip(prefix, req.hash_ids):
            if a != b:
                break
            n += 1
        del prefix[n:]
    return prefix
