"""What a simulation runs: the cluster's shape, the cost models, the SLOs, the options."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.conductor.costmodel import CostModel
from services.conductor.planner import PlannerSettings
from services.conductor.replication import ReplicationSettings


@dataclass
class SimConfig:
    num_prefill: int = 16
    num_decode: int = 16
    cache_blocks: int | None = 10_000  # per prefill instance; None = unlimited
    eviction: str = "lru"  # "lru" | "watermark" (services.kvmanager.pool)
    cost: CostModel = field(default_factory=CostModel)
    block_tokens: int = 512  # the trace's hash block size
    time_scale: float = 1.0  # arrival = trace timestamp x this (0.5 = twice the rate)
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.3
    slo_margin: float = 1.0
    balancing_threshold: float = 1.5
    reject: bool = True  # False: place even what the policy rejects (and count it)
    # Start with the blocks every request begins with (the system prompt) cached on every
    # prefill instance, as a deployment would. Without it the t=0 burst seeds block 0 on
    # a few instances only, and largest_prefix (which ranks by local match first) never
    # sends anything to the others for the rest of the trace.
    prewarm: bool = True
    # One machine's stack: the instances share this many cores (model.Cores), and their
    # work costs `work_cost` (a model fit on CPU time, the work without the wait for a
    # core), while the policy still predicts with `cost`. None: each has its own hardware.
    cores: float | None = None
    work_cost: CostModel | None = None
    # The rest of the machine's work on those cores (the gateway, the conductor, the bus,
    # the client, the engine processes' threads beside their steps): this many CPU
    # seconds come with each request as it arrives, and run beside the engines with
    # `background_weight` times an engine's share (engines niced n below it: 1.25^n, as
    # the kernel's fair scheduler weighs them), on at most `background_cap` cores.
    # bench replay --sim measures them over its live run.
    background_s_per_request: float = 0.0
    background_weight: float = 1.0
    background_cap: float = 1.0
    # Seeds the draws from measured spreads (the handoff's: work_cost.handoff_spread).
    seed: int = 0
    # Prefill runs the engine's chunked steps of this many tokens, packed across prompts
    # (model.ChunkedPrefillInstance); None: one whole prompt at a time, FIFO.
    prefill_chunk_tokens: int | None = None
    # Pipelined prefill: the policy may put a prompt on a group of up to this many idle
    # prefill instances (1: never), for prompts of at least pipeline_min_tokens (0: only
    # when no single instance meets the TTFT SLO). Groups need whole-prompt prefill
    # instances on their own hardware (no prefill_chunk_tokens, no cores).
    max_stages: int = 1
    pipeline_min_tokens: int = 0
    # The live prefill's default: a prompt longer than a chunk streams its KV to decode
    # while it is computed (handoff.py); False: all of it after the first token.
    streamed_handoff: bool = True
    # The live prefill's default too (--decode-reuse): a decode instance caches the prompts
    # it imported (a pool of cache_blocks), and a handoff moves only the blocks past the
    # prefix it holds (at least one); False: every handoff moves the whole prompt.
    decode_reuse: bool = True
    # The elastic P/D planner (services/conductor/planner.py), run every
    # planner.interval_s of simulated time from the num_prefill:num_decode split (elastic.py);
    # None: the split is fixed. In active mode an instance it switches drains, then after
    # switch_s (re-registering in its new role: about a heartbeat) serves the other role.
    planner: PlannerSettings | None = None
    switch_s: float = 1.0
    # Hot-prefix replication (services/conductor/replication.py, the live conductor's
    # code), fed by the KV manager's heat (kvmanager/heat.py) at these settings; None:
    # prefixes are copied only when kvcentric pulls one for a request.
    replication: ReplicationSettings | None = None
    hot_rps: float = 0.5
    heat_half_life_s: float = 5.0

    def __post_init__(self) -> None:
        # The policies size a prefix with cost.block_size, the pools count trace blocks:
        # they must be the same unit or predictions and hits disagree.
        if self.cost.block_size != self.block_tokens:
            raise ValueError(
                f"cost.block_size {self.cost.block_size} != block_tokens "
                f"{self.block_tokens}; see model.with_block_tokens"
            )
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        if self.background_s_per_request < 0:
            raise ValueError(f"background_s_per_request < 0: {self.background_s_per_request}")
        if self.max_stages > 1 and (self.cores or self.prefill_chunk_tokens):
            raise ValueError(
                "pipelined prefill is simulated on whole-prompt instances on their own "
                "hardware: max_stages > 1 takes neither cores nor prefill_chunk_tokens"
            )
        if self.planner is not None and self.max_stages > 1:
            raise ValueError("the planner moves single instances: it takes no max_stages > 1")
        if self.switch_s < 0:
            raise ValueError(f"switch_s < 0: {self.switch_s}")
