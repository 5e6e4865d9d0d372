"""Continuous-batching scheduler with chunked prefill (pure bookkeeping, no torch).

Every step has a token budget (the prefill chunk size). Running sequences go first, in
arrival order: a decoding sequence costs one token, a sequence still in its prompt gets
the next chunk. Waiting sequences are admitted after, reusing their cached prefix. When
the KV pool runs out, the most recently admitted running sequence is preempted: its
blocks are freed (they stay in the prefix cache until evicted) and it waits at the head
of the queue to be recomputed, so nothing ever runs out of memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per step: the prefill chunk size

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # the drafts included
    # Speculative tokens run after the sequence's last one (speculative.py): the step
    # computes them too, and keeps those the model agrees with.
    draft: tuple[int, ...] = ()

    @property
    def completes(self) -> bool:
        """After this step every known token has KV: the step yields a new token."""
        known = self.num_new_tokens - len(self.draft)
        return self.seq.num_computed_tokens + known == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in the pool (imported from a prefill instance)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.keep_partial(seq)  # its computed tail, for a prompt that repeats it
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decoding sequences first, whatever their admission order: a long prompt's chunk
        # must never hold back another sequence's next token.
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted earlier in this step
            draft = self._draft_that_fits(seq, budget)
            n = min(seq.num_uncomputed_tokens, budget) + len(draft)
            if not draft and not self._allocate_or_preempt(seq, n, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, n, draft))
            budget -= n
        return budget

    def _draft_that_fits(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The sequence's drafts, cut to the step's budget, with their blocks taken; none
        if the pool is short: a guess never preempts another sequence."""
        if seq.num_uncomputed_tokens != 1 or not seq.draft_token_ids:
            return ()
        draft = tuple(seq.draft_token_ids[: budget - 1])
        if draft and self.blocks.allocate(seq, 1 + len(draft)):
            return draft
        return ()

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for `seq`, preempting the newest running sequences; False if `seq` went."""
        while not self.blocks.allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                if not self.running:
                    raise PoolTooSmall(seq)  # alone and still short: it can never fit
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in arrival order. One whose cacheable prompt another
        running sequence is still computing waits for it (it then finds every full block
        in the prefix cache), so n samples of one prompt, or a burst of one system prompt,
        compute it once; the sequences behind it go ahead meanwhile."""
        computing = self._prompts_in_progress()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            key = self.blocks.prompt_key(seq)
            if key is not None and key in computing:
                continue
            self.blocks.match_prefix(seq)
            self.blocks.match_partial(seq)  # and the tokens of a kept partial block
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.blocks.allocate(seq, n):
                # Give the prefix blocks back while waiting: a waiting sequence holds nothing.
                self.blocks.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                if not self.running and not out.scheduled:
                    raise PoolTooSmall(seq)  # nothing else holds blocks: it can never fit
                return
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if key is not None and seq.num_computed_tokens < self.blocks.cacheable_tokens(seq):
                computing.add(key)  # it computes the shared blocks: its twins wait for them

    def _prompts_in_progress(self) -> set[int]:
        """Prompt keys of running sequences whose cacheable blocks are not all computed."""
        keys = set()
        for seq in self.running:
            key = self.blocks.prompt_key(seq)
            if key is not None and seq.num_computed_tokens < self.blocks.cacheable_tokens(seq):
                keys.add(key)
        return keys

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]

    def postprocess(self, item: ScheduledSeq) -> list[int]:
        """Account for a computed step; returns the hashes of newly full blocks. Drafts
        count once the engine has kept them (LLMEngine._emit_all)."""
        item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
        return self.blocks.commit(item.seq)


class PoolTooSmall(Exception):
    """A waiting prompt needs more blocks than the whole (idle) pool has."""

    def __init__(self, seq: Sequence) -> None:
        super().__init__(
            f"request {seq.request_id}: {seq.num_tokens} tokens do not fit the KV pool"
        )
        self.seq = seq
