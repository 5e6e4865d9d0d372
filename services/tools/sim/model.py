"""Simulated prefill and decode instances: pure bookkeeping, no I/O, no wall clock.

Times are simulated seconds handed in by the event loop (services/tools/sim/run.py). The KV
cache of a prefill instance is the engines' own block pool (shared/engine/block_manager.py,
driven by hash through services/kvmanager/pool.py); the loop mirrors every pool change
into the real KVIndex, as the live KV manager does from instance events.

Modelling choices (the honest simplifications):
- A prefill instance runs one prompt at a time, FIFO. What a prompt reuses is decided when
  it *starts* (its own pool then, plus a pulled prefix if the conductor asked for one and
  the holder still has it), as a live prefill looks up its cache when it runs the job.
  Its duration = transfer of the pulled blocks + cost.prefill_s(new, cached).
  ChunkedPrefillInstance runs the engine's chunked steps instead (the live stack's
  comparison uses it): the same reuse rule, prompts packed into steps of N tokens.
- queue_s shown to the policies = exact remaining time of the running prompt + the
  *predicted* time of the queued ones (their reuse is only known once they start).
- A decode instance runs continuous batching: every step produces one token for each
  sequence in the batch and takes cost.decode_step_s(batch, mean context). A sequence that
  arrives mid-step joins at the next step boundary.
- By default every instance has its own hardware (a cluster's nodes). With `Cores` the
  instances share that many cores, as the engine processes of a one-machine stack do:
  processor sharing, each busy instance running at min(1, cores / busy instances), so a
  prefill or a decode step takes longer exactly while the others are busy too. The rest
  of the machine's work (the gateway, the conductor, the bus) comes with each request and
  runs beside them by its scheduling weight (Cores' background).
- A handoff takes the cost model's line in blocks, or with a measured spread a draw from
  it (seeded: SimConfig.seed).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from services.conductor.costmodel import CostModel
from services.conductor.policy import InstanceView
from services.kvmanager.pool import HashPool
from shared.stats import slowest_tenth_mean


@dataclass(slots=True)
class SimRequest:
    index: int  # position in the trace
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class Outcome:
    """What happened to one request; times in simulated seconds."""

    request: SimRequest
    rejected: str = ""
    prefill_id: str = ""
    decode_id: str = ""
    predicted_ttft_s: float = 0.0
    reused_blocks: int = 0  # own + pulled, known at prefill start
    pulled_blocks: int = 0
    prefill_start_s: float = math.nan
    prefill_end_s: float = math.nan
    ttft_s: float = math.nan
    tbt_s: float = math.nan  # nan when there is no gap (a one-token answer)
    finish_s: float = math.nan

    def hit_tokens(self, block_tokens: int) -> int:
        """DESIGN.md's hit: reused leading blocks x block tokens, capped at the input."""
        return min(self.reused_blocks * block_tokens, self.request.input_length)


# ---- shared cores -------------------------------------------------------------------------

BACKGROUND = "~background"  # next_done's name for the background running dry


class Cores:
    """Processor sharing of `cores` cores among the busy instances, beside a background.

    Work is counted in virtual seconds (what a lone instance with a core to itself would
    take). While k instances are busy, virtual time runs at min(1, cores / k) per real
    second for each of them, so the work items finish in order of their virtual finish
    times, and the next one's real time follows from the current rate. Each change of
    the busy set first brings virtual time up to `now`.

    The background is the rest of the machine's work (the gateway, the conductor, the
    bus, the client): CPU seconds added as requests arrive (add_background), a backlog
    served beside the instances with `background_weight` times an instance's share, as
    the kernel's fair scheduler weighs processes by niceness, on at most
    `background_cap` cores. While it has work it runs at b = min(cap, cores·w / (w + k))
    and the instances share what is left: min(1, (cores - b) / k) each. Its backlog
    running dry is an event like an item's end (next_done names it BACKGROUND)."""

    def __init__(
        self, cores: float, background_weight: float = 1.0, background_cap: float = 1.0
    ) -> None:
        if not cores > 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        if not background_weight > 0 or not background_cap > 0:
            raise ValueError("the background's weight and cap must be > 0")
        self.cores = cores
        self.weight, self.cap = background_weight, min(background_cap, cores)
        self.v = 0.0  # virtual seconds elapsed
        self.t = 0.0  # real seconds when `v` was brought up to date
        self.backlog = 0.0  # the background's CPU seconds still to run
        self.finish: dict[str, float] = {}  # busy instance -> virtual finish of its item
        self._heap: list[tuple[float, str]] = []

    def background_rate(self) -> float:
        if self.backlog <= 0.0:
            return 0.0
        k = len(self.finish)
        return min(self.cap, self.cores * self.weight / (self.weight + k))

    def rate(self) -> float:
        k = len(self.finish)
        return min(1.0, (self.cores - self.background_rate()) / k) if k else 1.0

    def _sync(self, now: float) -> None:
        dt = now - self.t
        b = self.background_rate()
        if dt > 0.0 and b > 0.0 and dt * b >= self.backlog - 1e-12:
            # The background runs dry in this interval (next_done makes that an event, so
            # this is a rounding error, or a caller that skipped it): the rate changes there.
            dry = self.backlog / b
            self.v += dry * self.rate()
            self.backlog, dt = 0.0, dt - dry
        elif dt > 0.0:
            self.backlog -= dt * b
        self.v += dt * self.rate()
        self.t = now

    def add_background(self, now: float, work_s: float) -> None:
        if work_s > 0.0:
            self._sync(now)
            self.backlog += work_s

    def settle(self, now: float) -> None:
        """Bring the accounts up to `now` (the background ran dry: the rates change)."""
        self._sync(now)

    def begin(self, instance_id: str, now: float, work_s: float) -> None:
        self._sync(now)
        vf = self.v + work_s
        self.finish[instance_id] = vf
        heapq.heappush(self._heap, (vf, instance_id))

    def end(self, instance_id: str, now: float) -> None:
        self._sync(now)
        del self.finish[instance_id]

    def next_done(self) -> tuple[float, str] | None:
        """(real time, instance) of the next item to finish at the current rate, or
        (time, BACKGROUND) if the background runs dry first."""
        heap = self._heap
        while heap and self.finish.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # ended or replaced since it was pushed
        b = self.background_rate()
        dry = (self.t + self.backlog / b, BACKGROUND) if b > 0.0 else None
        if not heap:
            return dry
        vf, instance_id = heap[0]
        done = self.t + max(0.0, vf - self.v) / self.rate(), instance_id
        return dry if dry is not None and dry[0] < done[0] else done

    def remaining_s(self, instance_id: str, now: float) -> float:
        """Real seconds left of the instance's item at the current rate."""
        vf = self.finish.get(instance_id)
        if vf is None:
            return 0.0
        v_now = self.v + (now - self.t) * self.rate()
        return max(0.0, vf - v_now) / self.rate()


# ---- prefill ------------------------------------------------------------------------------


@dataclass(slots=True)
class PrefillJob:
    outcome: Outcome
    pull_from: str  # "" = own cache only
    pull_blocks: int  # prefix length the conductor expects to pull
    predicted_s: float  # transfer + prefill, as predicted at placement


@dataclass
class PrefillInstance:
    instance_id: str
    pool: HashPool
    queue: deque[PrefillJob] = field(default_factory=deque)
    running: PrefillJob | None = None
    running_end_s: float = 0.0
    queued_s: float = 0.0  # predicted seconds of the queued (not running) jobs
    cores: Cores | None = None  # shared with the other instances (None: its own hardware)
    _idle_view: InstanceView | None = field(default=None, repr=False)

    def view(self, now: float) -> InstanceView:
        """Queue: what is left of the running job plus the queued ones' predictions; load:
        queued + running. Built inline (a run builds ~10^7 of these); an idle instance's
        view holds until it gets work, a busy one's queue shrinks as its job runs."""
        if self.running is None:
            if self._idle_view is None:
                self._idle_view = InstanceView(
                    self.instance_id, self.queued_s, 0, 0.0, len(self.queue)
                )
            return self._idle_view
        if self.cores is None:
            ahead = self.running_end_s - now
        else:
            ahead = self.cores.remaining_s(self.instance_id, now)
        return InstanceView(
            self.instance_id, (ahead if ahead > 0.0 else 0.0) + self.queued_s, 1, 0.0,
            len(self.queue) + 1,
        )  # fmt: skip

    def enqueue(self, job: PrefillJob) -> None:
        self.queue.append(job)
        self.queued_s += job.predicted_s
        self._idle_view = None

    def start_next(self, now: float, cost: CostModel, block_tokens: int, pools: PoolLookup) -> bool:
        """Start the next queued job if idle; True if one started (its end is
        `running_end_s`). `pools` gives the pool of a job's pull_from instance."""
        if self.running is not None or not self.queue:
            return False
        job = self.queue.popleft()
        self.queued_s = max(0.0, self.queued_s - job.predicted_s)  # float drift stays >= 0
        cached, xfer_s = start_job(job, self.pool, pools, cost, block_tokens, now)
        req = job.outcome.request
        duration = xfer_s + cost.prefill_s(req.input_length - cached, cached)
        self.running, self.running_end_s = job, now + duration
        self._idle_view = None
        return True

    def finish_running(self) -> list[PrefillJob]:
        job, self.running = self.running, None
        if job is None:
            raise RuntimeError(f"{self.instance_id}: completion with no running job")
        return [job]


PoolLookup = Callable[[str], "HashPool | None"]


def start_job(
    job: PrefillJob,
    own_pool: HashPool,
    pools: PoolLookup,
    cost: CostModel,
    block_tokens: int,
    now: float,
) -> tuple[int, float]:
    """What a job reuses, decided when it starts: its instance's pool, or a pulled prefix
    if the conductor asked for one and the holder still has it. Returns (cached tokens,
    transfer seconds) and records the reuse in its outcome."""
    req = job.outcome.request
    own = own_pool.prefix_blocks(req.hash_ids)
    reuse, xfer_s = own, 0.0
    source = pools(job.pull_from) if job.pull_from else None
    if source is not None and job.pull_blocks > own:
        # The holder may have evicted part of it since placement: pull what is left.
        held = source.prefix_blocks(req.hash_ids[: job.pull_blocks])
        if held > own:
            source.touch(req.hash_ids[:held])  # read for the transfer
            reuse, xfer_s = held, cost.transfer_s(held - own)
            job.outcome.pulled_blocks = held - own
    job.outcome.reused_blocks = reuse
    job.outcome.prefill_start_s = now
    return min(reuse * block_tokens, req.input_length - 1), xfer_s


@dataclass(slots=True)
class _Chunked:
    job: PrefillJob
    cached: int  # tokens it reuses
    done: int = 0  # new tokens computed so far


@dataclass
class ChunkedPrefillInstance:
    """A prefill instance that runs the engine's chunked steps: each step computes up to
    `chunk_tokens` prompt tokens, taken in arrival order across the queued prompts (the
    engine's scheduler fills its token budget so: the tail of one prompt, then the head
    of the next), and every prompt whose last token is in the step gets its first token
    at the step's end. So a prompt's last step is padded with the next prompts' tokens,
    which FIFO of whole prompts leaves out. A chunk of n tokens after d computed ones
    costs prefill_s(d + n) - prefill_s(d) (with the prompt's cached tokens as context),
    so a prompt's chunks add up to its whole prefill_s."""

    instance_id: str
    pool: HashPool
    chunk_tokens: int
    cost: CostModel  # what its work takes (the loop's work model), and its queue's price
    queue: deque[PrefillJob] = field(default_factory=deque)
    cores: Cores | None = None
    running: list[PrefillJob] | None = None  # the jobs that finish with this step
    running_end_s: float = 0.0
    queued_s: float = 0.0  # predicted seconds of the jobs not started yet
    _active: deque[_Chunked] = field(default_factory=deque)  # started, not finished

    def view(self, now: float) -> InstanceView:
        """Queue: what is left of the running step, the started prompts' remaining tokens
        priced as the live conductor prices a heartbeat's queue, and the queued ones'
        predictions. Load: the unfinished prompts."""
        ahead = 0.0
        if self.running is not None:
            if self.cores is None:
                ahead = max(0.0, self.running_end_s - now)
            else:
                ahead = self.cores.remaining_s(self.instance_id, now)
        for a in self._active:
            left = a.job.outcome.request.input_length - a.cached - a.done
            if left > 0:
                ahead += self.cost.prefill_s(left, a.cached + a.done)
        n = len(self._active) + len(self.queue)
        return InstanceView(
            self.instance_id, ahead + self.queued_s, int(bool(self.running)), 0.0, n
        )

    def enqueue(self, job: PrefillJob) -> None:
        self.queue.append(job)
        self.queued_s += job.predicted_s

    def start_next(self, now: float, cost: CostModel, block_tokens: int, pools: PoolLookup) -> bool:
        """Start a step if idle and there is work; True if one started."""
        if self.running is not None or not (self._active or self.queue):
            return False
        budget, duration, finishing = self.chunk_tokens, 0.0, []
        for a in list(self._active):
            if budget <= 0:
                break
            budget, duration = self._chunk(a, budget, duration, cost, finishing)
        while budget > 0 and self.queue:
            job = self.queue.popleft()
            self.queued_s = max(0.0, self.queued_s - job.predicted_s)
            cached, xfer_s = start_job(job, self.pool, pools, cost, block_tokens, now)
            a = _Chunked(job, cached)
            self._active.append(a)
            budget, duration = self._chunk(a, budget, duration + xfer_s, cost, finishing)
        for a in finishing:
            self._active.remove(a)
        self.running = [a.job for a in finishing]
        self.running_end_s = now + duration
        return True

    @staticmethod
    def _chunk(
        a: _Chunked, budget: int, duration: float, cost: CostModel, finishing: list[_Chunked]
    ) -> tuple[int, float]:
        new = a.job.outcome.request.input_length - a.cached
        n = min(new - a.done, budget)
        duration += cost.prefill_s(a.done + n, a.cached) - (
            cost.prefill_s(a.done, a.cached) if a.done else 0.0
        )
        a.done += n
        if a.done >= new:
            finishing.append(a)
        return budget - n, duration

    def finish_running(self) -> list[PrefillJob]:
        jobs, self.running = self.running, None
        if jobs is None:
            raise RuntimeError(f"{self.instance_id}: completion with no running step")
        return jobs


# ---- decode -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Seq:
    outcome: Outcome
    context: int  # tokens at join: the prompt and the first token
    join_step: int = 0
    last_step: int = 0
    first_gap_s: float = 0.0  # first token (prefill) -> second token (first decode step)


class DecodeInstance:
    """Continuous batching, advanced lazily: the loop calls `advance(t)` before it looks
    at or changes the instance, so steps cost no heap events (a run has ~10^6 of them)."""

    def __init__(self, instance_id: str, cost: CostModel, cores: Cores | None = None) -> None:
        self.instance_id = instance_id
        self.cost = cost
        # Shared cores: the loop ends each step (end_shared_step) when `cores` says it is
        # done, since its length depends on what the other instances do meanwhile.
        self.cores = cores
        self.durations: list[float] = []  # step i took durations[i] seconds
        self.busy = False
        self.step_start_s = 0.0
        self.step_end_s = 0.0
        self.running = 0  # sequences in the current step's batch
        self.sum_context = 0  # their tokens, all together
        self.waiting: list[_Seq] = []  # ready (KV arrived), join at the next boundary
        self.fresh: list[_Seq] = []  # joined the step in progress
        self.leaving: list[tuple[int, int, _Seq]] = []  # (last step, trace index, seq)
        self.assigned = 0  # placed here, KV not arrived yet (still in prefill or transfer)
        self.assigned_context = 0
        self._view: InstanceView | None = None  # until the next change (a run builds ~10^7)

    def view(self) -> InstanceView:
        """Held or incoming sequences, as the live decode view counts dispatched ones."""
        if self._view is None:
            n = self.running + len(self.waiting) + self.assigned
            ctx = self.sum_context + sum(s.context for s in self.waiting) + self.assigned_context
            self._view = InstanceView(
                self.instance_id, running=n, mean_context=ctx / n if n else 0.0, load=n
            )
        return self._view

    def assign(self, context: int) -> None:
        self.assigned += 1
        self.assigned_context += context
        self._view = None

    def unassign(self, context: int) -> None:
        """A placed sequence that will never arrive (its answer was the prefill's token)."""
        self.assigned -= 1
        self.assigned_context -= context
        self._view = None

    def arrive(self, outcome: Outcome, now: float) -> None:
        """The sequence's KV is in place at `now` (the loop advanced us to `now`)."""
        req = outcome.request
        seq = _Seq(outcome, req.input_length + 1)
        self.assigned -= 1
        self.assigned_context -= seq.context
        self.waiting.append(seq)
        self._view = None
        if not self.busy:
            self._start_step(now)

    def advance(self, t: float) -> None:
        """Run every step that ends at or before `t`. Most steps change nothing but the
        context (nobody joins, nobody leaves): those run inline, with decode_step_s's
        arithmetic to the bit (a 10x trace on 128 decode instances has ~10^7 steps)."""
        durations, leaving = self.durations, self.leaving
        a, b, c = self.cost.decode_coef
        while self.busy and self.step_end_s <= t:
            step = len(durations) - 1
            if (
                self.fresh
                or self.waiting
                or self.cores is not None
                or (leaving and leaving[0][0] == step)
            ):
                self._end_step()
                continue
            self._view = None
            now, n = self.step_end_s, self.running
            self.sum_context += n  # one new token per sequence
            d = a * 1.0 + b * n + c * (n * (self.sum_context / n))
            d = d if d > 0.0 else 0.0
            durations.append(d)
            self.step_start_s, self.step_end_s = now, now + d

    def _end_step(self) -> None:
        self._view = None
        now, step = self.step_end_s, len(self.durations) - 1
        self.sum_context += self.running  # one new token per sequence
        for seq in self.fresh:
            seq.first_gap_s = now - seq.outcome.prefill_end_s
        self.fresh = []
        leaving = self.leaving
        while leaving and leaving[0][0] == step:
            self._finish(heapq.heappop(leaving)[2], now)
        self._start_step(now)

    def _finish(self, seq: _Seq, now: float) -> None:
        self.running -= 1
        self.sum_context -= seq.context + seq.last_step - seq.join_step + 1
        gaps = [seq.first_gap_s, *self.durations[seq.join_step + 1 : seq.last_step + 1]]
        seq.outcome.tbt_s = slowest_tenth_mean(gaps)
        seq.outcome.finish_s = now

    def _start_step(self, now: float) -> None:
        step = len(self.durations)
        for seq in self.waiting:
            # The prefill made token 1; decode makes the other output_length - 1.
            seq.join_step, seq.last_step = step, step + seq.outcome.request.output_length - 2
            self.running += 1
            self.sum_context += seq.context
            heapq.heappush(self.leaving, (seq.last_step, seq.outcome.request.index, seq))
        self.fresh, self.waiting = self.waiting, []
        if not self.running:
            self.busy = False
            return
        duration = self.cost.decode_step_s(self.running, self.sum_context / self.running)
        self.durations.append(duration)  # with shared cores, replaced at the step's end
        self.busy, self.step_start_s = True, now
        if self.cores is None:
            self.step_end_s = now + duration
        else:
            self.step_end_s = math.inf  # advance() never ends it: the loop does
            self.cores.begin(self.instance_id, now, duration)

    def end_shared_step(self, now: float) -> None:
        """The running step is done at `now` (shared cores: the loop calls this)."""
        assert self.cores is not None and self.busy
        self.cores.end(self.instance_id, now)
        self.durations[-1] = now - self.step_start_s
        self.step_end_s = now
        self._end_step()


# ---- cost presets -------------------------------------------------------------------------


def llama3_70b_8xa800() -> CostModel:
    """An approximation of the paper's setting (LLaMA3-70B-like model, one 8xA800 node per
    instance), derived from first principles, not measured:

    - prefill, linear: ~140 GFLOP per token (2 x 70e9 params) at ~1.4 PFLOP/s effective
      (8 x 312 TFLOPS bf16 at ~55% MFU) -> 1.0e-4 s/token.
    - prefill, attention: ~2.6 MFLOP per (query, key) pair (4 x d_model 8192 x 80 layers);
      causal, so n^2/2 pairs among new tokens (-> 1e-9 s x n^2) and n x cached pairs
      against the reused prefix (-> 2e-9 s x n x c). 8k new tokens: ~0.9 s; 16k: ~1.9 s.
    - decode step: ~25 ms floor (140 GB of weights over 8 x 2 TB/s HBM is ~9 ms, plus
      tensor-parallel all-reduces and launches), 0.2 ms per sequence, and KV reads of
      320 KiB per context token (GQA: 80 layers x 8 KV heads x 128 x K,V x bf16) at about
      half of 16 TB/s -> 4e-8 s per batch x context token. Batch 16 at 12k context: ~36 ms.
    - transfer: a 512-token block is 160 MiB; 200 Gbps RDMA (25 GB/s) + 1 ms latency, so
      one block takes ~7 ms and a 24-block prompt ~160 ms.
    """
    return CostModel(
        prefill_coef=[0.02, 1.0e-4, 1.0e-9, 2.0e-9],
        decode_coef=[0.025, 2.0e-4, 4.0e-8],
        transfer_latency_s=0.001,
        transfer_bytes_per_s=25e9,
        overhead_s=0.0,
        block_bytes=512 * 327_680,
        block_size=512,
        source="preset llama3-70b-8xa800 (first-principles approximation)",
    )


PRESETS = {"llama3-70b-8xa800": llama3_70b_8xa800}


def with_block_tokens(cost: CostModel, block_tokens: int) -> CostModel:
    """The same model with `block_tokens`-token blocks (the trace's hashing unit): bytes
    per token are kept, so a fitted model's 16-token block becomes a 512-token one."""
    if cost.block_size == block_tokens:
        return cost
    per_token = cost.block_bytes / cost.block_size
    return replace(cost, block_size=block_tokens, block_bytes=round(per_token * block_tokens))
