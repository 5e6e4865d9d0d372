"""What every part of the engine shares: the KV pool, its bookkeeping, the requests, and
the lock that guards them (the concurrency contract is in llm_engine.py)."""

from __future__ import annotations

import threading
from pathlib import Path

from shared.engine.block_manager import BlockManager
from shared.engine.connector import KVConnector
from shared.engine.constraints import caught_up
from shared.engine.disk_tier import DiskLink, DiskTier
from shared.engine.engine_types import EngineConfig, RequestState
from shared.engine.kv_cache import KVCache
from shared.engine.kv_slices import SliceProgress
from shared.engine.kv_transfer import KVMeta, check_compatible
from shared.engine.model import PagedModel
from shared.engine.output import OutputTracker, decode_all, make_detokenizer
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.sequence import Sequence


class EngineCore:
    """The pool (KV tensors, blocks, disk tier), the scheduler's queues, the requests
    running and the reservations waiting for their KV."""

    def __init__(
        self, lm: LoadedModel, config: EngineConfig, connector: KVConnector | None = None
    ) -> None:
        self.lm = lm
        self.config = config
        self.connector = connector  # None: every request decodes here (see connector.py)
        shape = PagedModel.kv_shape(lm.config, config.block_size, lm.dtype)
        num_blocks = shape.num_blocks_for(config.kv_cache_bytes)
        self.kv = KVCache(shape, num_blocks, lm.device)
        self.model = PagedModel(lm.model, self.kv, config.quantization, lean=config.lean_weights)
        self.blocks = BlockManager(num_blocks, config.block_size, config.hot_hits, config.pin_ttl_s)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.blocks
        )
        self.requests: dict[str, RequestState] = {}
        # Decode admission: pool blocks held for a request whose KV is still in transfer.
        self.reserved: dict[str, Sequence] = {}
        # Before that: the leading blocks of a prompt this pool caches already, pinned for a
        # handoff that will bring only the rest (KVHandoff.hold_prefix).
        self.held: dict[str, Sequence] = {}
        # Of those, the ones whose KV arrives in layer slices (a pipelined prefill's).
        self.slices: dict[str, SliceProgress] = {}
        self.book = threading.Lock()  # bookkeeping: steps vs. exports and imports
        self.disk: DiskTier | None = None
        if config.disk_tier_bytes > 0:
            self.disk = DiskTier(Path(config.disk_tier_dir), config.disk_tier_bytes)
        self.tier = DiskLink(self.disk, self.kv, self.blocks)

    def check_fits(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """ValueError unless every token id is in the vocabulary, the prompt fits the
        context, and prompt + output the pool. Checked before a request joins a batch: an
        id past the embedding table (or a logit_bias key past the logits) fails the whole
        step, every request in it included."""
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens < 1:
            raise ValueError("empty prompt")
        vocab = int(self.lm.config.vocab_size)
        biased = [t for t, _ in params.logit_bias]
        for ids in (prompt_token_ids, output_token_ids or [], biased):
            if ids and not (0 <= min(ids) and max(ids) < vocab):
                raise ValueError(f"token ids must be in [0, {vocab}): got {min(ids)}..{max(ids)}")
        if num_prompt_tokens >= self.lm.max_model_len:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens exceeds the context")
        need = -(-(num_prompt_tokens + params.max_tokens) // self.config.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"{num_prompt_tokens}+{params.max_tokens} tokens exceed the KV pool "
                f"({self.blocks.num_blocks * self.config.block_size} tokens)"
            )

    def check_kv(self, meta: KVMeta) -> None:
        """ValueError unless KV from elsewhere fits this pool (model, layout, quantization)."""
        check_compatible(meta, self.kv, self.lm.name, self.config.quantization)

    def register(
        self, seq: Sequence, output_token_ids: list[int] | None = None, emitted_text: str = ""
    ) -> RequestState:
        """Track a new request, or one continuing here after `output_token_ids` of which
        `emitted_text` was streamed already."""
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id}")
        done = list(output_token_ids or [])
        tok, skip = self.lm.tokenizer, seq.params.skip_special_tokens
        tracker = OutputTracker(
            seq.params,
            make_detokenizer(tok, done, skip),
            self.lm.eos_token_ids,
            seq.num_prompt_tokens,
            self.lm.max_model_len,
            token_ids=done,
            text=decode_all(tok, done, skip),
            emitted_text=emitted_text,
        )
        constraint = seq.params.constraint
        matcher = (
            None
            if constraint is None
            else caught_up(tok, int(self.lm.config.vocab_size), constraint, done)
        )
        req = RequestState(seq, tracker, matcher)
        self.requests[seq.request_id] = req
        return req

    def finish(self, seq: Sequence) -> None:
        """Forget a request and free its blocks (its full ones stay cached)."""
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)
