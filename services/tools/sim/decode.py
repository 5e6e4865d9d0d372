"""A simulated decode instance: continuous batching, one token per sequence per step."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from services.conductor.costmodel import CostModel
from services.conductor.views import InstanceView
from services.kvmanager.pool import HashPool
from services.tools.sim.cores import Cores
from services.tools.sim.model import Outcome
from shared.stats import slowest_tenth_mean


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

    def __init__(
        self,
        instance_id: str,
        cost: CostModel,
        cores: Cores | None = None,
        pool: HashPool | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.cost = cost
        self.pool = pool  # the prompts whose KV came here (decode-side reuse); None: not kept
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

    @property
    def idle(self) -> bool:
        """No sequence running, waiting to join or headed here (still in prefill or its
        handoff). Its last step ended at step_end_s."""
        return not self.busy and not self.waiting and not self.assigned

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
        if self.pool is not None:
            self.pool.admit(req.hash_ids, now)
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
