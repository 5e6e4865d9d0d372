"""Simulated prefill instances: whole prompts FIFO (PrefillInstance) or the engine's
chunked steps (ChunkedPrefillInstance), with what a prompt reuses decided when it starts."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from services.conductor.costmodel import CostModel
from services.conductor.views import InstanceView
from services.kvmanager.pool import HashPool
from services.tools.sim.cores import Cores
from services.tools.sim.model import Outcome


@dataclass(slots=True)
class PrefillJob:
    outcome: Outcome
    pull_from: str  # "" = own cache only
    pull_blocks: int  # prefix length the conductor expects to pull
    predicted_s: float  # transfer + prefill, as predicted at placement
    # A stage of a pipelined prefill: its place in the group (-1: a whole prompt alone);
    # only the last stage's end gives the first token.
    stage: int = -1
    last: bool = True
    group: str = ""  # the group's holder id in the index (shared/groups.py)


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

    @property
    def idle(self) -> bool:
        """Nothing running or queued (an elastic cluster's drain waits for it)."""
        return self.running is None and not self.queue

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

    def run_stage(self, job: PrefillJob, now: float, end_s: float) -> None:
        """Hold the (idle) instance for its stage of a pipelined prefill until `end_s`."""
        if self.running is not None or self.queue:
            raise RuntimeError(f"{self.instance_id}: a stage placed on a busy instance")
        self.running, self.running_end_s = job, end_s
        self._idle_view = None

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

    @property
    def idle(self) -> bool:
        """No step running, no prompt started or queued."""
        return self.running is None and not self._active and not self.queue

    def start_next(self, now: float, cost: CostModel, block_tokens: int, pools: PoolLookup) -> bool:
        """Start a step if idle and there is work; True if one started."""
        if self.running is not None or not (self._active or self.queue):
            return False
        budget, duration = self.chunk_tokens, 0.0
        finishing: list[_Chunked] = []
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
        duration += cost.chunk_s(a.done, n, a.cached)
        a.done += n
        if a.done >= new:
            finishing.append(a)
        return budget - n, duration

    def finish_running(self) -> list[PrefillJob]:
        jobs, self.running = self.running, None
        if jobs is None:
            raise RuntimeError(f"{self.instance_id}: completion with no running step")
        return jobs
