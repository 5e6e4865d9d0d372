"""The engine: scheduler + block manager (bookkeeping) around the paged model (tensors).

Concurrency contract. Three threads may touch an engine:
- the engine thread (the instance's one executor) calls everything that changes the
  batch: add_request, add_prefilled, add_recompute, import_prefix, abort, step,
  prompt_logprobs;
- an exporter thread may call export_prefix at any time, so a prefix pull never waits for
  a long prefill chunk;
- an exporter thread may also call export_streamable (prefill), so a long prompt's
  computed blocks go to decode while its next chunk runs;
- an importer thread (decode) may call reserve, fill_reserved, add_reserved and release
  at any time, so a handed-off request joins the batch at the next step instead of
  waiting for the step in flight to end before its blocks are even reserved.
`_book` guards the block bookkeeping, the scheduler's queues and every KV write into a
block an export could name (a cached, hashed block). Every method above holds it while it
changes any of them, and none releases it inside: step() takes it to plan, drops it for
the forward pass, takes it again to account for the results. The forward pass writes only
slots of blocks that the step's sequences hold (freshly allocated, or partly filled and so
without a hash), which no export can name and no reservation holds; hashed blocks are
complete and are never written. An import writes only its reservation's own blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from shared.engine import kernels
from shared.engine.batch import build_batch
from shared.engine.block_manager import BlockManager
from shared.engine.connector import KVConnector
from shared.engine.disk_tier import DiskTier
from shared.engine.kv_cache import KVCache
from shared.engine.kv_transfer import (
    KVExport,
    check_compatible,
    export_cached,
    export_full_blocks,
    export_sequence,
    fill_sequence,
    import_sequence,
)
from shared.engine.logits import RowContext, TokenLogprobs
from shared.engine.model import PagedLlama
from shared.engine.output import OutputTracker, decode_all, make_detokenizer
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.engine.sampling import Sampled, sample
from shared.engine.scheduler import (
    PoolTooSmall,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from shared.engine.sequence import Sequence
from shared.hashing import block_hashes
from shared.messages import CostSample, FinishReason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # prefill chunk size
    disk_tier_bytes: int = 0  # 0: no disk tier
    disk_tier_dir: str = ""
    hot_hits: int = 3  # soft-pin blocks hit this often (0: no pins)
    pin_ttl_s: float = 60.0
    eviction: Literal["lru", "watermark"] = "lru"  # watermark: Mooncake Store's proactive mode
    high_watermark: float = 0.90
    evict_ratio: float = 0.05
    quantization: Literal["none", "int8"] = "none"  # the linears' weights (int8: weight-only)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    handoff: KVExport | None = None  # prefill role: the prompt's KV, for a decode instance
    logprobs: list[TokenLogprobs] | None = None  # per new token, when the request asks


@dataclass
class _Request:
    seq: Sequence
    tracker: OutputTracker
    matcher: Any = None  # structured output: the grammar's state (constraints.py)
    first_token_time: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """What heartbeats, metrics and benches read of an engine (LLMEngine.stats())."""

    running: int = 0  # sequences in the running batch
    waiting: int = 0  # sequences waiting for their prompt to start
    queue_prompts: tuple[int, ...] = ()  # prompt tokens left per unfinished prompt
    mean_context: float = 0.0  # tokens per decoding sequence (what a decode step costs)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # free blocks may still hold cached prefixes
    kv_blocks_cached: int = 0
    kv_blocks_reserved: int = 0  # held for KV still in transfer (decode admission)
    prefix_hit_tokens: int = 0  # running totals since start
    prefix_miss_tokens: int = 0
    preemptions: int = 0
    evicted_blocks: int = 0


@dataclass
class PromptScores:
    """Teacher-forced scores of a token sequence, for positions 1 .. n-1."""

    token_logprobs: torch.Tensor  # [n-1] fp32: log p of the token that is there
    top_ids: torch.Tensor  # [n-1, k] long: the k most likely tokens at each position
    top_logprobs: torch.Tensor  # [n-1, k] fp32


@dataclass(frozen=True, slots=True)
class StepTime:
    """A step's wall time, and the CPU time of the threads that ran it in turn (the engine
    thread, and the instance's loop between steps; with one compute thread, its time with
    a core to itself: see CostSample.cpu_seconds). Also a pair of clock marks."""

    wall_s: float
    cpu_s: float


@dataclass
class StepStats:
    num_tokens: int = 0
    num_seqs: int = 0
    seconds: float = 0.0
    preempted: int = 0
    kv_stored: list[int] = field(default_factory=list)
    kv_evicted: list[int] = field(default_factory=list)
    disk_stored: list[int] = field(default_factory=list)
    disk_removed: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self, lm: LoadedModel, config: EngineConfig, connector: KVConnector | None = None
    ) -> None:
        self.lm = lm
        self.config = config
        self.connector = connector  # None: every request decodes here (see connector.py)
        shape = PagedLlama.kv_shape(lm.model.config, config.block_size, lm.dtype)
        num_blocks = shape.num_blocks_for(config.kv_cache_bytes)
        self.kv = KVCache(shape, num_blocks, lm.device)
        self.model = PagedLlama(lm.model, self.kv, config.quantization)
        self.blocks = BlockManager(num_blocks, config.block_size, config.hot_hits, config.pin_ttl_s)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.blocks
        )
        self.requests: dict[str, _Request] = {}
        # Decode admission: pool blocks held for a request whose KV is still in transfer.
        self.reserved: dict[str, Sequence] = {}
        self.last_step = StepStats()
        self._book = threading.Lock()  # bookkeeping: steps vs. exports and imports (module doc)
        self.disk: DiskTier | None = None
        self._disk_stored: list[int] = []
        # Running totals for metrics: prompt tokens served from the prefix cache (any tier,
        # pulled ones too) or computed, counted once per prompt; sequences preempted.
        self.num_prefix_hit_tokens = 0
        self.num_prefix_miss_tokens = 0
        self.num_preemptions = 0
        # Called with each step's stats on the engine thread (metrics histograms lock).
        self.on_step: Callable[[StepStats], None] | None = None
        # What work cost, for the conductor's online cost model (drained by heartbeats;
        # deque appends and pops are atomic, so the loop thread may drain it).
        self.cost_samples: deque[CostSample] = deque(maxlen=256)
        # CPU seconds of the steps' cycles since start (step() and the instance's serial
        # work between steps): what the cost samples' cpu_seconds add up to. A simulator
        # of a one-machine stack counts the rest of the machine's CPU apart from it.
        self.work_cpu_s = 0.0
        if config.disk_tier_bytes > 0:
            self.disk = DiskTier(Path(config.disk_tier_dir), config.disk_tier_bytes)
            self.blocks.keep_spills = True
        log.info(
            "KV pool: %d blocks of %d tokens (%.0f MiB); %s, quantization %s; native kernels: %s",
            num_blocks,
            config.block_size,
            self.kv.nbytes / 2**20,
            str(lm.dtype).removeprefix("torch."),
            config.quantization,
            kernels.status() if self.model.native else "off (torch path)",
        )

    # -- intake -------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, salt: str = ""
    ) -> None:
        self._check_fits(len(prompt_token_ids), params)
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params, salt)
        with self._book:
            self._register(seq)
            self._load_from_disk(seq)
            self.scheduler.add(seq)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        kv: KVExport,
        emitted_text: str = "",
        salt: str = "",
    ) -> bool:
        """Continue a request prefilled elsewhere; False if the pool has no room yet."""
        self._check_fits(len(prompt_token_ids), params)
        check_compatible(kv.meta, self.kv, self.lm.name, self.config.quantization)
        seq = _continuation(request_id, prompt_token_ids, output_token_ids, params, salt)
        with self._book:
            if seq.request_id in self.requests:
                raise ValueError(f"duplicate request id {seq.request_id}")
            if not import_sequence(self.kv, self.blocks, seq, kv, on_allocate=self._spill):
                return False
            self._register(seq, output_token_ids, emitted_text)
            self.scheduler.add_running(seq)
        return True

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
        self._check_fits(len(prompt_token_ids), params)
        seq = _continuation(request_id, prompt_token_ids, output_token_ids, params, salt)
        with self._book:
            self._register(seq, output_token_ids, emitted_text)
            self._load_from_disk(seq)
            self.scheduler.add(seq)

    # -- decode admission: KV slots reserved before a transfer starts ---------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        num_kv_tokens: int,
        salt: str = "",
    ) -> bool:
        """Hold pool blocks for a request's KV before fetching it (as SGLang's decode
        prealloc queue does); False, holding nothing, if the pool has no room now. Full
        blocks of the prompt this pool already caches (a sibling sample's) are shared,
        not fetched again into new ones."""
        self._check_fits(len(prompt_token_ids), params)
        seq = _continuation(request_id, prompt_token_ids, output_token_ids, params, salt)
        if not 0 < num_kv_tokens <= seq.num_tokens:
            raise ValueError(f"KV of {num_kv_tokens} tokens for a sequence of {seq.num_tokens}")
        with self._book:
            if request_id in self.requests or request_id in self.reserved:
                raise ValueError(f"duplicate request id {request_id}")
            self.blocks.match_prefix(seq)
            if seq.num_computed_tokens > num_kv_tokens:  # never more than the KV covers
                self.blocks.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
            if not self.blocks.allocate(seq, num_kv_tokens - seq.num_computed_tokens):
                self.blocks.free(seq)
                return False
            self._spill()  # what the allocation evicted goes to disk before it is overwritten
            self.reserved[request_id] = seq
        return True

    def fill_reserved(self, request_id: str, kv: KVExport) -> int:
        """Write a streamed chunk of a reserved request's KV into its blocks (the request
        stays reserved until add_reserved brings the rest); returns the blocks in place.
        On a bad chunk the reservation is kept: the rest may still come whole."""
        check_compatible(kv.meta, self.kv, self.lm.name, self.config.quantization)
        with self._book:
            seq = self.reserved.get(request_id)
            if seq is None:
                raise ValueError(f"request {request_id} has no reservation")
            fill_sequence(self.kv, self.blocks, seq, kv)
            return seq.num_computed_tokens // self.config.block_size

    def add_reserved(
        self, request_id: str, kv: KVExport, output_token_ids: list[int], emitted_text: str = ""
    ) -> None:
        """Continue a reserved request with its fetched KV (all of it, or what a stream
        left): written into its blocks, then into the running batch. A reservation made
        before the first token existed (a stream's) takes the tokens now. On a bad payload
        its blocks go back to the pool."""
        check_compatible(kv.meta, self.kv, self.lm.name, self.config.quantization)
        with self._book:
            seq = self.reserved.pop(request_id, None)
            if seq is None:
                raise ValueError(f"request {request_id} has no reservation")
            if seq.num_output_tokens == 0:
                seq.token_ids.extend(output_token_ids)
            try:
                fill_sequence(self.kv, self.blocks, seq, kv)
            except ValueError:
                self.blocks.free(seq)
                raise
            self._register(seq, output_token_ids, emitted_text)
            self.scheduler.add_running(seq)

    def release(self, request_id: str) -> bool:
        """Give back a reservation (cancelled, or its transfer failed)."""
        with self._book:
            seq = self.reserved.pop(request_id, None)
            if seq is None:
                return False
            self.blocks.free(seq)
        return True

    def export_prefix(self, hashes: list[int]) -> KVExport | None:
        """Cached blocks of a prefix, for an instance that wants to reuse them. Safe from any
        thread: it looks up and copies under the bookkeeping lock (see the module doc)."""
        with self._book:
            return export_cached(
                self.kv, self.blocks, hashes, self.lm.name, self.config.quantization
            )

    def export_streamable(self, request_id: str, first_block: int) -> KVExport | None:
        """The full blocks a prompt still in prefill has computed from `first_block` on
        (a streamed handoff's next chunk), or None: none new, or the prompt is done or gone.
        Safe from any thread, as export_prefix is."""
        with self._book:
            req = self.requests.get(request_id)
            if req is None or req.seq.num_output_tokens > 0:
                return None
            return export_full_blocks(
                self.kv, req.seq, first_block, self.lm.name, self.config.quantization
            )

    def import_prefix(self, token_ids: list[int], export: KVExport, salt: str = "") -> int:
        """Add pulled prefix blocks to this pool's prefix cache; returns the tokens they cover.

        The hashes must be those of `token_ids` (same tokens, same tenant): blocks from
        elsewhere are never trusted blindly. 0 when the pool has no room right now.
        """
        check_compatible(export.meta, self.kv, self.lm.name, self.config.quantization)
        n_tokens = export.meta.num_blocks * self.config.block_size
        expected = block_hashes(token_ids[:n_tokens], self.config.block_size, salt)
        if export.meta.block_hashes != expected or len(expected) != export.meta.num_blocks:
            raise ValueError("pulled KV blocks do not match this prompt's prefix hashes")
        seq = Sequence(
            f"import:{expected[-1]:x}",
            list(token_ids[:n_tokens]),
            n_tokens,
            SamplingParams(max_tokens=1),
            salt,
        )
        with self._book:  # the allocation may evict a block an export is about to copy
            if not import_sequence(self.kv, self.blocks, seq, export, on_allocate=self._spill):
                return 0
            self.blocks.free(seq)  # unreferenced but cached: the next match_prefix finds them
        return n_tokens

    def prompt_logprobs(self, token_ids: list[int], top_k: int = 0) -> PromptScores:
        """For positions 1 .. n-1: log p(token i | tokens before it), and the `top_k` most
        likely tokens there with their logprobs. Every position's logits, computed chunk by
        chunk through the paged model on a throwaway sequence (its full blocks stay in the
        prefix cache). Engine thread only."""
        self._check_fits(len(token_ids), SamplingParams(max_tokens=1))
        seq = Sequence(
            f"score:{id(token_ids):x}",
            list(token_ids),
            len(token_ids),
            SamplingParams(max_tokens=1),
        )
        out: list[torch.Tensor] = []
        tops: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            while seq.num_computed_tokens < seq.num_tokens:
                n = min(self.config.max_num_batched_tokens, seq.num_uncomputed_tokens)
                with self._book:
                    if not self.blocks.allocate(seq, n):
                        raise ValueError("the KV pool has no room to score this text now")
                item = ScheduledSeq(seq, n)
                batch, _ = build_batch(
                    [item], self.config.block_size, self.lm.device, all_logits=True
                )
                logits = self.model.forward(batch).float()
                pos = seq.num_computed_tokens
                targets = torch.tensor(token_ids[pos + 1 : pos + n + 1], dtype=torch.long)
                logprobs = torch.log_softmax(logits[: len(targets)], dim=-1)
                out.append(logprobs.gather(1, targets.unsqueeze(1)).squeeze(1))
                if top_k:
                    top = torch.topk(logprobs, top_k, dim=-1)
                    tops.append((top.indices, top.values))
                with self._book:
                    self.scheduler.postprocess(item)
        finally:
            with self._book:
                self.blocks.free(seq)
        empty = torch.empty(len(token_ids) - 1, 0)
        return PromptScores(
            torch.cat(out),
            torch.cat([t[0] for t in tops]) if tops else empty.long(),
            torch.cat([t[1] for t in tops]) if tops else empty,
        )

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens < 1:
            raise ValueError("empty prompt")
        if num_prompt_tokens >= self.lm.max_model_len:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens exceeds the context")
        need = -(-(num_prompt_tokens + params.max_tokens) // self.config.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"{num_prompt_tokens}+{params.max_tokens} tokens exceed the KV pool "
                f"({self.blocks.num_blocks * self.config.block_size} tokens)"
            )

    def _register(
        self, seq: Sequence, output_token_ids: list[int] | None = None, emitted_text: str = ""
    ) -> _Request:
        """Track a new request, or one continuing here after `output_token_ids` of which
        `emitted_text` was streamed already."""
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id}")
        done = list(output_token_ids or [])
        tok = self.lm.tokenizer
        tracker = OutputTracker(
            seq.params,
            make_detokenizer(tok, done),
            self.lm.eos_token_ids,
            seq.num_prompt_tokens,
            self.lm.max_model_len,
            token_ids=done,
            text=decode_all(tok, done),
            emitted_text=emitted_text,
        )
        req = _Request(seq, tracker, self._matcher(seq.params, done))
        self.requests[seq.request_id] = req
        return req

    def _matcher(self, params: SamplingParams, done: list[int]) -> Any:
        """The request's grammar state, caught up with the tokens it already has (a request
        continuing here after its prefill elsewhere)."""
        if params.constraint is None:
            return None
        from shared.engine.constraints import matcher

        m = matcher(self.lm.tokenizer, int(self.lm.model.config.vocab_size), params.constraint)
        if done and not m.consume_tokens(done):
            raise ValueError("the tokens so far do not match the request's grammar")
        return m

    def abort(self, request_id: str) -> bool:
        with self._book:
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
        with self._book:
            try:
                sched = self._schedule()
            except PoolTooSmall as exc:
                return [self._fail(exc.seq.request_id, str(exc))]
        outputs: list[RequestOutput] = []
        if sched.scheduled:
            batch, order = build_batch(sched.scheduled, self.config.block_size, self.lm.device)
            logits = self.model.forward(batch)
            with self._book:
                outputs = self._finish_step(order, logits, StepTime(t0, c0))
        with self._book:
            self._record_step(sched, time.perf_counter() - t0)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        self.blocks.now = time.monotonic()
        if self.config.eviction == "watermark":
            self.blocks.evict_to_watermark(self.config.high_watermark, self.config.evict_ratio)
        sched = self.scheduler.schedule()
        self._spill()  # evicted blocks go to disk before this step's KV overwrites them
        return sched

    def _record_step(self, sched: SchedulerOutput, seconds: float) -> None:
        stored, evicted = self.blocks.drain_events()
        disk_stored, self._disk_stored = self._disk_stored, []
        disk_removed = self.disk.drain_removed() if self.disk else []
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

    # -- disk tier ------------------------------------------------------------------------
    def _spill(self) -> None:
        if self.disk is None:
            return
        for block_hash, block_id, tokens in self.blocks.take_spills():
            k, v = self.kv.block_data(block_id)
            if self.disk.put(block_hash, tokens, k, v):
                self._disk_stored.append(block_hash)

    def _load_from_disk(self, seq: Sequence) -> int:
        """Bring the prompt's prefix blocks that only the disk tier has back into DRAM."""
        if self.disk is None:
            return 0
        bs = self.config.block_size
        hashes = block_hashes(seq.token_ids[: (seq.num_tokens - 1) // bs * bs], bs, seq.salt)
        n_dram = len(self.blocks.cached_chain(hashes))
        on_disk = 0
        while n_dram + on_disk < len(hashes) and hashes[n_dram + on_disk] in self.disk:
            on_disk += 1
        if not on_disk:
            return 0
        n_total = n_dram + on_disk
        tmp = Sequence(
            "disk-load",
            seq.token_ids[: n_total * bs] + [0],
            n_total * bs + 1,
            SamplingParams(max_tokens=1),
            seq.salt,
        )
        loaded = 0
        if self.blocks.match_prefix(tmp) == n_dram * bs and self.blocks.allocate(tmp, on_disk * bs):
            self._spill()
            loaded = self._read_disk_blocks(tmp, hashes, n_dram, on_disk)
            tmp.num_computed_tokens = (n_dram + loaded) * bs
            self.blocks.commit(tmp)
        self.blocks.free(tmp)
        return loaded * bs

    def _read_disk_blocks(self, tmp: Sequence, hashes: list[int], start: int, count: int) -> int:
        bs, loaded = self.config.block_size, 0
        k_like, v_like = self.kv.k[:, 0], self.kv.v[:, 0]
        for i in range(start, start + count):
            got = self.disk.get(hashes[i], k_like, v_like) if self.disk else None
            if got is None or got[0] != tuple(tmp.token_ids[i * bs : (i + 1) * bs]):
                break
            self.kv.write_block(tmp.block_table[i], got[1], got[2])
            loaded += 1
        return loaded

    def _finish_step(
        self, order: list[ScheduledSeq], logits: torch.Tensor, started: StepTime
    ) -> list[RequestOutput]:
        """`started`: the cycle's start (perf_counter, thread_time)."""
        completing = [item for item in order if item.completes]
        sampled = self._sample(completing, logits)
        spent = StepTime(time.perf_counter() - started.wall_s, time.thread_time() - started.cpu_s)
        self.work_cpu_s += spent.cpu_s
        self._account(order, spent)
        for item in order:
            self.scheduler.postprocess(item)
        return [
            self._emit(item.seq, tok, lp)
            for item, tok, lp in zip(completing, sampled.tokens, sampled.logprobs)
        ]

    def _account(self, order: list[ScheduledSeq], spent: StepTime) -> None:
        """Each prompt's share of the step (by tokens) toward its prefill time; a step of
        decodes only is one decode sample."""
        tokens = sum(item.num_new_tokens for item in order)
        if all(item.num_new_tokens == 1 and item.seq.num_output_tokens > 0 for item in order):
            ctx = sum(item.seq.num_tokens for item in order) / len(order)
            self.cost_samples.append(
                CostSample(
                    kind="decode",
                    tokens=len(order),
                    context=ctx,
                    seconds=spent.wall_s,
                    cpu_seconds=spent.cpu_s,
                )
            )
            return
        for item in order:
            if item.seq.num_output_tokens == 0:
                share = item.num_new_tokens / tokens
                item.seq.prefill_seconds += spent.wall_s * share
                item.seq.prefill_cpu_seconds += spent.cpu_s * share

    def _sample(self, items: list[ScheduledSeq], logits: torch.Tensor) -> Sampled:
        rows = []
        for item in items:
            seq, req = item.seq, self.requests[item.seq.request_id]
            stops = frozenset(seq.params.stop_token_ids) | (
                frozenset() if seq.params.ignore_eos else self.lm.eos_token_ids
            )
            rows.append(
                RowContext(
                    seq.params,
                    seq.num_output_tokens,
                    seq.token_ids,
                    seq.num_prompt_tokens,
                    stops,
                    req.matcher,
                )
            )
        return sample(logits, rows)

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
            self._finish(seq)
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
            self._finish(seq)
        return out

    def _finish(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        req = self.requests[request_id]
        seq = req.seq
        self._finish(seq)
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
        with self._book:
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
        )


def _continuation(
    request_id: str,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    params: SamplingParams,
    salt: str,
) -> Sequence:
    """A request that goes on from tokens produced elsewhere: prompt + output so far."""
    tokens = list(prompt_token_ids) + list(output_token_ids)
    return Sequence(request_id, tokens, len(prompt_token_ids), params, salt)
