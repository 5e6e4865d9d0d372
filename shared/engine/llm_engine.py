"""The engine: scheduler + block manager (bookkeeping) around the paged model (tensors).

Its parts: engine_core.py holds the pool, the queues, the requests and the lock;
handoff.py adds KV that crosses instances (handoffs, reservations, prefix pulls);
this module adds requests in and the steps. disk_tier.py's DiskLink spills evicted
blocks and loads prefixes back, prompt_logprobs.py scores a text, engine_types.py has
the configuration, outputs and per-request state.

Concurrency contract. Three threads may touch an engine:
- the engine thread (the instance's one executor) calls everything that changes the
  batch: add_request, add_prefilled, add_recompute, import_prefix, abort, step,
  prompt_logprobs;
- an exporter thread may call export_prefix at any time, so a prefix pull never waits for
  a long prefill chunk;
- an exporter thread may also call export_streamable (prefill), so a long prompt's
  computed blocks go to decode while its next chunk runs;
- an importer thread (decode) may call hold_prefix, reserve, fill_reserved, add_reserved and
  release at any time, so a handed-off request joins the batch at the next step instead of
  waiting for the step in flight to end before its blocks are even reserved.
`book` guards the block bookkeeping, the scheduler's queues and every KV write into a
block an export could name (a cached, hashed block). Every method above holds it while it
changes any of them, and none releases it inside: step() takes it to plan, drops it for
the forward pass, takes it again to account for the results. The forward pass writes only
slots of blocks that the step's sequences hold (freshly allocated, or partly filled and so
without a hash), which no export can name and no reservation holds; hashed blocks are
complete and are never written. An import writes only its reservation's own blocks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import Callable

import torch

from shared.engine import kernels
from shared.engine.batch import build_batch
from shared.engine.connector import KVConnector
from shared.engine.engine_types import (
    EngineConfig,
    EngineStats,
    PromptScores,
    RequestOutput,
    StepStats,
    StepTime,
    continuation,
)
from shared.engine.handoff import KVHandoff
from shared.engine.kv_transfer import export_sequence
from shared.engine.logits import TokenLogprobs
from shared.engine.params import SamplingParams
from shared.engine.prompt_logprobs import score_prompt
from shared.engine.runner import LoadedModel
from shared.engine.scheduler import PoolTooSmall, ScheduledSeq, SchedulerOutput
from shared.engine.sequence import Sequence
from shared.engine.step_tokens import StepTokens
from shared.kv_load import KVLoadError, KVLoadFailures
from shared.messages import CostSample, FinishReason

# The engine's types, importable from here as before the split.
__all__ = [
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "PromptScores",
    "RequestOutput",
    "StepStats",
    "StepTime",
]

log = logging.getLogger(__name__)


class LLMEngine(KVHandoff, StepTokens):
    """The pool and the handoffs (KVHandoff, EngineCore), plus requests in and steps
    (the tokens a step drafts and yields: StepTokens)."""

    def __init__(
        self, lm: LoadedModel, config: EngineConfig, connector: KVConnector | None = None
    ) -> None:
        super().__init__(lm, config, connector)
        self.last_step = StepStats()
        # Running totals for metrics: prompt tokens served from the prefix cache (any tier,
        # pulled ones too) or computed, counted once per prompt; sequences preempted.
        self.num_prefix_hit_tokens = 0
        self.num_prefix_miss_tokens = 0
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative tokens proposed, and kept, since start
        self.num_accepted_tokens = 0
        # Failed KV loads by kind and outcome, under the deployment's policy (kv_load.py):
        # the disk tier's here; the instance counts pulls and handoffs in the same one.
        self.kv_load_failures = KVLoadFailures(config.kv_load_failure)
        # Called with each step's stats on the engine thread (metrics histograms lock).
        self.on_step: Callable[[StepStats], None] | None = None
        # What work cost, for the conductor's online cost model (drained by heartbeats;
        # deque appends and pops are atomic, so the loop thread may drain it).
        self.cost_samples: deque[CostSample] = deque(maxlen=256)
        # CPU seconds of the steps' cycles since start (step() and the instance's serial
        # work between steps): what the cost samples' cpu_seconds add up to. A simulator
        # of a one-machine stack counts the rest of the machine's CPU apart from it.
        self.work_cpu_s = 0.0
        log.info(
            "KV pool: %d blocks of %d tokens (%.0f MiB); %s, quantization %s; native kernels: %s",
            self.blocks.num_blocks,
            config.block_size,
            self.kv.nbytes / 2**20,
            str(lm.dtype).removeprefix("torch."),
            config.quantization,
            kernels.status() if self.model.native else "off (torch path)",
        )
        if self.blocks.num_blocks * config.block_size < lm.max_model_len:
            # Not fatal (shorter requests run), but a long one will be refused: say so now.
            log.warning(
                "the KV pool holds %d tokens, less than the %d-token context: longer "
                "requests are refused; raise --kv-cache-gb (HALFMOON_KV_CACHE_GB)",
                self.blocks.num_blocks * config.block_size,
                lm.max_model_len,
            )

    # -- intake -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        salt: str = "",
        use_disk: bool = True,
    ) -> None:
        """`use_disk` False: blocks of this prompt on the disk tier stay there and are
        computed (the conductor priced reading them above recomputing them)."""
        self.check_fits(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params, salt)
        with self.book:
            self.register(seq)
            if use_disk:
                self._load_from_disk(seq)
            self.scheduler.add(seq)

    def add_recompute(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        emitted_text: str = "",
        salt: str = "",
    ) -> None:
        """Continue a request whose KV is out of reach (its transfer failed, or the instance
        that held it died): prompt + tokens so far are computed again here, as a preempted
        sequence is, and the stream goes on after the text already emitted."""
        self.check_fits(prompt_token_ids, params, output_token_ids)
        seq = continuation(request_id, prompt_token_ids, output_token_ids, params, salt)
        with self.book:
            self.register(seq, output_token_ids, emitted_text)
            self._load_from_disk(seq)
            self.scheduler.add(seq)

    def _load_from_disk(self, seq: Sequence) -> None:
        """The prefix blocks only the disk tier holds, back into the pool. One that fails
        to load is recomputed, or, under the "fail" policy, the request is dropped and
        KVLoadError raised (bookkeeping lock held)."""
        t0 = time.perf_counter()
        loaded = self.tier.load(seq)
        if loaded:  # what reading the disk tier costs, for the conductor's cost model
            seconds = time.perf_counter() - t0
            self.cost_samples.append(
                CostSample(kind="disk", tokens=loaded, context=0.0, seconds=seconds)
            )
        if self.tier.fault and self.kv_load_failures.failed("disk"):
            del self.requests[seq.request_id]
            raise KVLoadError(self.tier.fault)

    def prompt_logprobs(self, token_ids: list[int], top_k: int = 0) -> PromptScores:
        """Teacher-forced scores of `token_ids` (prompt_logprobs.py). Engine thread only."""
        return score_prompt(self, token_ids, top_k)

    def abort(self, request_id: str) -> bool:
        with self.book:
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            self.scheduler.finish(req.seq)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -----------------------------------------------------------------------
    def step(self, between: StepTime | None = None) -> list[RequestOutput]:
        """Plan under the lock, run the forward pass without it (an export from another
        thread never waits for a long prefill chunk), account for the results under it.

        `between` is the instance's serial work since its previous step (publishing that
        step's tokens, admitting handoffs), when it stepped on without waiting for work.
        A step's cost is its whole cycle, from the previous step's end to this one's
        tokens: what a running sequence waits between two tokens. (The forward pass alone
        was about three quarters of a decode cycle on a busy 2-core stack.)"""
        t0, c0 = time.perf_counter(), time.thread_time()
        if between is not None:  # the cycle started that much earlier
            t0, c0 = t0 - between.wall_s, c0 - between.cpu_s
        with self.book:
            try:
                sched = self._schedule()
            except PoolTooSmall as exc:
                return [self._fail(exc.seq.request_id, str(exc))]
        outputs: list[RequestOutput] = []
        if sched.scheduled:
            batch, order = build_batch(sched.scheduled, self.config.block_size, self.lm.device)
            logits = self.model.forward(batch)
            with self.book:
                outputs = self._finish_step(order, logits, StepTime(t0, c0))
        with self.book:
            self._record_step(sched, time.perf_counter() - t0)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        self.blocks.now = time.monotonic()
        if self.config.eviction == "watermark":
            self.blocks.evict_to_watermark(self.config.high_watermark, self.config.evict_ratio)
        self._draft()
        sched = self.scheduler.schedule()
        self._copy_partials()
        self.tier.spill()  # evicted blocks go to disk before this step's KV overwrites them
        return sched

    def _copy_partials(self) -> None:
        """The kept partial blocks admitted prompts reuse, copied into blocks of their own
        before the forward pass writes the rest of them (block_manager.match_partial)."""
        copies = self.blocks.take_copies()
        for src, dst in copies:
            self.kv.write_block(dst, *self.kv.block_data(src))
        self.blocks.release(src for src, _ in copies)

    def _record_step(self, sched: SchedulerOutput, seconds: float) -> None:
        stored, evicted = self.blocks.drain_events()
        disk_stored, disk_removed = self.tier.drain_stored(), self.tier.drain_removed()
        self.num_preemptions += len(sched.preempted)
        self.last_step = StepStats(
            sched.num_tokens,
            len(sched.scheduled),
            seconds,
            len(sched.preempted),
            stored,
            evicted,
            disk_stored,
            disk_removed,
        )
        if self.on_step is not None:
            self.on_step(self.last_step)

    def _finish_step(
        self, order: list[ScheduledSeq], logits: torch.Tensor, started: StepTime
    ) -> list[RequestOutput]:
        """`started`: the cycle's start (perf_counter, thread_time)."""
        completing = [item for item in order if item.completes]
        tokens, logprobs = self._sample(completing, logits)
        spent = StepTime(time.perf_counter() - started.wall_s, time.thread_time() - started.cpu_s)
        self.work_cpu_s += spent.cpu_s
        self._account(order, spent, sum(len(t) for t in tokens))
        for item in order:
            self.scheduler.postprocess(item)
        return [
            self._emit_all(item, toks, lp) for item, toks, lp in zip(completing, tokens, logprobs)
        ]

    def _emit_all(
        self, item: ScheduledSeq, tokens: list[int], logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        """A step's tokens for one sequence: one, or the drafts it kept and one more.
        A kept draft's KV is computed, so it counts once it is in the sequence."""
        if len(tokens) == 1:
            return self._emit(item.seq, tokens[0], logprobs)
        seq = item.seq
        self.num_draft_tokens += len(item.draft)
        self.num_accepted_tokens += len(tokens) - 1
        outs = []
        for i, token in enumerate(tokens):
            outs.append(self._emit(seq, token))
            if outs[-1].finish_reason is not None:
                break
            if i < len(tokens) - 1:
                seq.num_computed_tokens += 1
                self.blocks.commit(seq)
        last = outs[-1]
        last.new_token_ids = [t for o in outs for t in o.new_token_ids]
        last.text = "".join(o.text for o in outs)
        return last

    def _account(self, order: list[ScheduledSeq], spent: StepTime, emitted: int) -> None:
        """Each prompt's share of the step (by tokens) toward its prefill time; a step of
        decodes only is one decode sample. With drafts, a step yields `emitted` tokens
        for its len(order) sequences: the sample is the time per token a sequence saw
        (what the conductor's TBT model predicts), not the longer step itself."""
        tokens = sum(item.num_new_tokens for item in order)
        decoding = (item.num_new_tokens - len(item.draft) == 1 for item in order)
        if all(decoding) and all(item.seq.num_output_tokens > 0 for item in order):
            ctx = sum(item.seq.num_tokens for item in order) / len(order)
            per_token = len(order) / max(emitted, len(order))
            self.cost_samples.append(
                CostSample(
                    kind="decode",
                    tokens=len(order),
                    context=ctx,
                    seconds=spent.wall_s * per_token,
                    cpu_seconds=spent.cpu_s * per_token,
                )
            )
            return
        for item in order:
            if item.seq.num_output_tokens == 0:
                share = item.num_new_tokens / tokens
                item.seq.prefill_seconds += spent.wall_s * share
                item.seq.prefill_cpu_seconds += spent.cpu_s * share

    def _emit(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        req = self.requests[seq.request_id]
        seq.token_ids.append(token)
        step = req.tracker.append(token)
        if req.matcher is not None:
            req.matcher.consume_token(token)
            if step.finish_reason is None and req.matcher.is_stopped():
                # The grammar is complete: nothing may follow this token's text.
                end = req.tracker.stop()
                step = replace(end, text=step.text + end.text)
        if seq.num_output_tokens == 1:  # its prompt is done (never true for an import)
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            self.num_prefix_miss_tokens += seq.num_prompt_tokens - seq.num_cached_tokens
            if seq.num_preemptions == 0:  # a recompute's time is not a prompt's cost
                self.cost_samples.append(
                    CostSample(
                        kind="prefill",
                        tokens=seq.num_prompt_tokens - seq.num_cached_tokens,
                        context=float(seq.num_cached_tokens),
                        seconds=seq.prefill_seconds,
                        cpu_seconds=seq.prefill_cpu_seconds,
                    )
                )
        out = RequestOutput(
            seq.request_id,
            [token],
            step.text,
            step.finish_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_cached_tokens,
            logprobs=[logprobs] if logprobs is not None else None,
        )
        if step.finish_reason is not None:
            self.finish(seq)
        elif (
            seq.num_output_tokens == 1
            and self.connector is not None
            and self.connector.hands_off(seq.request_id)
        ):
            out.handoff = export_sequence(
                self.kv,
                self.blocks,
                seq,
                self.lm.name,
                self.config.quantization,
                self.connector.streamed_blocks(seq.request_id),
            )
            self.finish(seq)
        return out

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        req = self.requests[request_id]
        seq = req.seq
        self.finish(seq)
        return RequestOutput(
            request_id,
            [],
            "",
            FinishReason.ERROR,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_cached_tokens,
            error=why,
        )

    # -- state for heartbeats, metrics and benchmarks -------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot, safe to read from other threads once taken (any thread: it takes
        the bookkeeping lock, which is not held during a forward pass)."""
        with self.book:
            return self._stats_locked()

    def _stats_locked(self) -> EngineStats:
        sched = self.scheduler
        seqs = sched.running + list(sched.waiting)
        decoding = [s for s in sched.running if s.num_uncomputed_tokens <= 1]
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            queue_prompts=tuple(
                s.num_uncomputed_tokens for s in seqs if s.num_uncomputed_tokens > 1
            ),
            mean_context=(sum(s.num_tokens for s in decoding) / len(decoding) if decoding else 0.0),
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_free=self.blocks.num_free_blocks,
            kv_blocks_cached=self.blocks.num_cached_blocks,
            kv_blocks_reserved=sum(len(s.block_table) for s in self.reserved.values()),
            prefix_hit_tokens=self.num_prefix_hit_tokens,
            prefix_miss_tokens=self.num_prefix_miss_tokens,
            preemptions=self.num_preemptions,
            evicted_blocks=self.blocks.num_evictions,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
        )
