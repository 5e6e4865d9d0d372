"""The engine's configuration, what it returns, and what it keeps per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from shared.engine.kv_transfer import KVExport
from shared.engine.logits import TokenLogprobs
from shared.engine.output import OutputTracker
from shared.engine.params import SamplingParams
from shared.engine.sequence import Sequence
from shared.engine.speculative import NgramDrafter, SpeculativeConfig
from shared.kv_load import KVLoadFailurePolicy
from shared.messages import FinishReason


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
    kv_load_failure: KVLoadFailurePolicy = "recompute"  # an unreadable disk block (kv_load.py)
    high_watermark: float = 0.90
    evict_ratio: float = 0.05
    quantization: Literal["none", "int8"] = "none"  # the linears' weights (int8: weight-only)
    # One copy of each weight where the native kernels take every row count, and
    # transformers' own copies released (its model cannot run after): see model.py.
    lean_weights: bool = False
    speculative: SpeculativeConfig = SpeculativeConfig()  # prompt-lookup drafts (off: 0)


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
class RequestState:
    """A request the engine is running: its sequence, its text so far, its grammar."""

    seq: Sequence
    tracker: OutputTracker
    matcher: Any = None  # structured output: the grammar's state (constraints.py)
    first_token_time: float | None = None
    drafter: NgramDrafter | None = None  # made on its first decode step that may draft


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
    spec_draft_tokens: int = 0  # speculative tokens proposed, and kept, since start
    spec_accepted_tokens: int = 0


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


def continuation(
    request_id: str,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    params: SamplingParams,
    salt: str,
) -> Sequence:
    """A request that goes on from tokens produced elsewhere: prompt + output so far."""
    tokens = list(prompt_token_ids) + list(output_token_ids)
    return Sequence(request_id, tokens, len(prompt_token_ids), params, salt)
