"""Typed, versioned messages that cross the bus (JSON via pydantic).

Every message carries `v`: one of a version this code does not speak is refused, not
misread. Replies that can fail are the payload or {"error": ErrorBody} (shared.bus).
Values are bounded where they are parsed: anyone who can reach the bus can send a message
(a buggy peer, a version skew, a stranger), and a value no sender of ours would send is
refused as an invalid request before any service acts on it (tests/e2e/test_bus_fuzz.py).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

SCHEMA_VERSION = 1

# Request ids name NATS subjects (tokens.<id>: no dots, wildcards or spaces) and SQL keys
# (64 characters); instance ids name subjects and SQL keys of 128.
RequestId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
InstanceId = Annotated[str, StringConstraints(max_length=128)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # the engine checks its own vocabulary
Hash64 = Annotated[int, Field(ge=0, lt=2**64)]  # shared.hashing: 64 bits, unsigned
# JSON-safe integers: a double holds every integer below 2**53 exactly.
COUNT_LIMIT = 2**53
Count = Annotated[int, Field(ge=0, lt=COUNT_LIMIT)]
Seconds = Annotated[float, Field(ge=0.0, le=1e12, allow_inf_nan=False)]  # or a timestamp
Port = Annotated[int, Field(ge=0, le=65535)]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    v: int = Field(SCHEMA_VERSION, ge=1, le=SCHEMA_VERSION)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


class Role(StrEnum):
    GATEWAY = "gateway"
    CONDUCTOR = "conductor"
    KVMANAGER = "kvmanager"
    PREFILL = "prefill"
    DECODE = "decode"


# What an engine serves as (services/worker/roles.py). "colocated": a prefill instance
# that decodes its own requests (its heartbeat says so); no other instance hands it KV.
EngineRole = Literal["prefill", "decode", "colocated"]


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class Constraint(BaseModel):
    """Structured output (shared.engine.params.Constraint on the bus)."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "lark"]
    spec: str = ""


class SamplingParams(BaseModel):
    """What the gateway validated; the engine's own type is shared.engine.params."""

    # The gateway's bounds (services/gateway/protocol.py), again for what comes off the bus.
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Count = 0  # 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: Count = 256
    min_tokens: Count = 0
    stop: list[str] = Field(default_factory=list, max_length=64)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=300
    )
    logprobs: int | None = Field(None, ge=0, le=20)  # None: none; k: the chosen and top k
    constraint: Constraint | None = None
    # Speculative drafts per step (None: the deployment's; 0: none for this request).
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)
    # False: special tokens stay in the text (a tool format whose marker is one; set by the
    # gateway, never by a client).
    skip_special_tokens: bool = True


class TokenLogprob(BaseModel):
    """One generated (or prompt) token's logprob and the top tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class ErrorBody(BaseModel):
    code: str
    message: str
    retry_after_s: float | None = None
    status: int = 500  # the HTTP status it maps to, so the kind survives the bus


class Ack(Message):
    """A job was taken (queued); the work itself reports on the token stream."""

    ok: bool = True


class KVActivity(BaseModel):
    """An instance's KV traffic since it started (cumulative; the conductor's load samples
    turn it into counts per interval, so a lost heartbeat loses nothing)."""

    blocks_stored: int = 0  # DRAM tier: blocks registered in the prefix cache
    blocks_evicted: int = 0
    disk_stored: int = 0
    disk_removed: int = 0
    transfers_in: int = 0  # KV fetched from another instance (handoffs, prefix pulls)
    transfers_out: int = 0  # KV another instance fetched from this one
    bytes_in: int = 0
    bytes_out: int = 0
    handoffs: int = 0  # decode: handoffs fetched, their bytes, and the bytes of prompt...
    handoff_bytes: int = 0
    handoff_held_bytes: int = 0  # ...blocks it held already (decode-side reuse), not fetched
    replicas: int = 0  # prefill: hot prefixes copied in ahead of demand, and their bytes
    replica_bytes: int = 0


class CostSample(BaseModel):
    """What a piece of an engine's work cost, for the conductor's online cost model:
    a request's prefill (tokens computed, tokens cached), a decode step (batch size,
    mean context), a handoff (KV tokens moved; seconds from prefill's first token to
    the KV in place on decode), or a dispatch (prompt tokens; seconds from the gateway's
    arrival to the job in a prefill instance's hands: the request's way in, which every
    TTFT holds beside its queue and prefill), or a disk load (tokens read back)."""

    kind: Literal["prefill", "decode", "handoff", "dispatch", "disk"]
    tokens: Count
    context: float = Field(ge=0.0, le=1e9, allow_inf_nan=False)
    seconds: Seconds
    # The engine thread's CPU time in that work (time.thread_time): what it costs with a
    # core to itself. Wall seconds also hold the time it waited for a core, which on a
    # machine whose engines share cores grows with the cluster's load; the simulator
    # shares cores itself (SimConfig.cores), so it wants the work without the waiting.
    cpu_seconds: Seconds | None = None


class InstanceInfo(Message):
    """What a heartbeat says about its sender."""

    instance_id: InstanceId
    role: Role
    host: str = "127.0.0.1"
    pid: Count = 0
    started_at: Seconds = 0.0
    sent_at: Seconds = 0.0
    # "switching": an engine draining towards another role (see services/worker/roles.py);
    # no new work lands on it, and it comes back as `switching_to` once drained.
    status: Literal["ready", "draining", "switching"] = "ready"
    switching_to: EngineRole | None = None
    # A prefill engine that decodes what it prefills (the "colocated" role) in a
    # disaggregated pool: it takes whole requests, never another instance's handoff.
    colocated: bool = False
    kv_host: str = ""
    kv_port: Port = 0
    queue_depth: Count = 0  # requests waiting
    running: Count = 0  # requests being computed
    kv_tokens_used: Count = 0
    queue_prompts: list[Count] = Field(default_factory=list)  # tokens left per queued prompt
    mean_context: float = Field(0.0, ge=0.0, le=1e9, allow_inf_nan=False)  # per sequence
    model: str = ""
    kv_blocks_total: Count = 0  # DRAM tier; free blocks may still hold cached prefixes
    kv_blocks_free: Count = 0
    kv_blocks_cached: Count = 0
    # Blocks' worth of KV held for a transfer: offered and not fetched yet (prefill), or
    # reserved in the pool for KV still arriving (decode). Back to 0 when idle.
    kv_blocks_leased: Count = 0
    disk_blocks_used: Count = 0  # disk tier (0 and 0 without one)
    disk_blocks_free: Count = 0
    kv_activity: KVActivity = Field(default_factory=KVActivity)
    # Engines: what picks the cost model's prior (model, dtype, quantization, threads, CPU),
    # and the costs of work done since the previous heartbeat.
    engine_key: str = ""
    cost_samples: list[CostSample] = Field(default_factory=list)
    # Engines: CPU seconds of their steps since start (what the cost samples' cpu_seconds
    # add up to). Against the machine's busy CPU over a run, it tells how much of the
    # cores everything else took (bench replay --sim).
    work_cpu_s: float = 0.0
    # Conductors: whether this one holds the lease and places requests (others are standbys),
    # and the lease's term (grows with each new leader; 0 when not leading).
    leader: bool = False
    term: int = 0
    cost_model: str = ""  # where its predictions come from (prior, online calibration)
    # Engine cost samples its cost model has learned from, by kind.
    cost_samples_seen: dict[str, int] = Field(default_factory=dict)
    # The model it predicts with now (CostModel's fields but its source and key), so a
    # simulator can run with what the live conductor learned (bench replay --sim).
    cost_params: dict[str, float | int | list[float]] = Field(default_factory=dict)
    # and the same model fit on the engines' CPU time (empty until they report it)
    cpu_cost_params: dict[str, float | int | list[float]] = Field(default_factory=dict)
    # and the settings it places with (policy, default SLOs, margin, pull threshold, layout)
    placement: dict[str, float | str] = Field(default_factory=dict)


class GenerateRequest(Message):
    """One accepted request, as the gateway hands it to the conductor."""

    request_id: RequestId
    model: str
    prompt_token_ids: list[TokenId]
    block_hashes: list[Hash64] = Field(default_factory=list)
    sampling: SamplingParams
    arrival_time: Seconds
    tenant: str = ""
    # per-request SLOs (None or 0: the conductor's defaults)
    ttft_slo_ms: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    tbt_slo_ms: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    # Completions' echo with logprobs: every prompt position scored, top k each (the
    # prefill instance computes them; cached positions have no logits of their own).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # A later sample of an n > 1 request: the prefill instance its first sample went to,
    # where the prompt is computed once for all of them (policy.follow).
    follow_prefill: str = ""


class Placement(Message):
    request_id: RequestId
    prefill_id: str
    decode_id: str
    policy: str = ""
    predicted_ttft_ms: float = 0.0


class PrefillJob(Message):
    request: GenerateRequest
    decode_id: str = ""  # where decode runs; empty when colocated (see `colocated`)
    # Cache load balancing: pull this many prefix blocks from another instance first.
    prefix_from: str = ""
    prefix_blocks: Count = 0
    # The conductor priced reading this prompt's blocks back from the instance's disk tier
    # above computing them again: the engine leaves them there and computes them.
    skip_disk: bool = False

    @property
    def colocated(self) -> bool:
        """The prefill instance decodes the request itself: no decode instance named."""
        return not self.decode_id


class KVHandle(BaseModel):
    """Where the decode side fetches a prefilled KV cache from (data plane, never NATS)."""

    transfer_id: str = Field(max_length=256)
    host: str
    port: Port
    nbytes: Count
    num_tokens: Count
    # Shared memory (shared.transfer.shm): a receiver whose host_id matches maps the
    # segment instead of streaming it; anyone else fetches the same transfer over TCP.
    transport: Literal["tcp", "shm"] = "tcp"
    shm_name: str = ""  # empty: the sender writes the segment when a receiver asks
    host_id: str = ""


class KVChunk(Message):
    """Prefill → decode, request/reply, while a long prompt is computed: its next full
    blocks, offered at `kv`, for the blocks a KVHold (whole) reserved. Acked once in place."""

    request_id: RequestId
    prefill_id: str
    kv: KVHandle


class StageRef(BaseModel):
    """One stage of a pipelined prefill: an instance and the layers it runs."""

    instance_id: str
    first_layer: Count
    end_layer: Count


class StageJob(Message):
    """Conductor → each prefill instance of a group (pipelined prefill, CPP): run layers
    [first, end) of the request's prompt, a chunk at a time. Stage 0 embeds the tokens;
    each later stage takes the one before's hidden states (StageHop); the last samples
    the first token and hands decode every stage's KV slice. All stages compute from
    `start_tokens`, a prefix every one of them holds (the group's least hit)."""

    request: GenerateRequest
    stages: list[StageRef] = Field(min_length=2, max_length=64)
    index: Count
    decode_id: str = Field(min_length=1)
    start_tokens: Count = 0

    @model_validator(mode="after")
    def _a_pipeline(self) -> StageJob:
        if self.index >= len(self.stages):
            raise ValueError(f"stage {self.index} of a {len(self.stages)}-stage group")
        bounds = [(s.first_layer, s.end_layer) for s in self.stages]
        contiguous = all(end == first for (_, end), (first, _) in zip(bounds, bounds[1:]))
        if bounds[0][0] != 0 or not contiguous or any(a >= b for a, b in bounds):
            raise ValueError(f"stages must split the layers from 0 contiguously: {bounds}")
        return self

    @property
    def me(self) -> StageRef:
        return self.stages[self.index]

    @property
    def last(self) -> bool:
        return self.index == len(self.stages) - 1


class StageOpened(Message):
    """A stage's answer to its StageJob: the prompt's leading tokens its pool holds."""

    hit_tokens: Count


class StageClose(Message):
    """Conductor → a stage it opened, when another stage of the group refused: drop the
    prompt (the request goes elsewhere; unlike a cancel, it is not ended)."""

    request_id: RequestId


class StageHop(Message):
    """Stage → the next stage, request/reply: one chunk's hidden states are offered at
    `hidden` (data plane); acked once fetched. The prompt's last chunk also carries the
    KV slices of the stages so far, for the last stage to hand decode."""

    request_id: RequestId
    hidden: KVHandle
    slices: list[KVHandle] = Field(default_factory=list, max_length=64)


class DecodeJob(Message):
    request: GenerateRequest
    prefill_id: str
    # None: recompute prompt + output_token_ids here (the gateway re-placing a request whose
    # decode instance died, or whose events were lost), with no KV to fetch; unless
    # kv_slices holds a pipelined prefill's KV.
    kv: KVHandle | None
    # A pipelined prefill's KV: one slice (some layers, every block) per stage.
    kv_slices: list[KVHandle] = Field(default_factory=list, max_length=64)
    # Leading blocks decode holds already (its cached prefix, pinned by a KVHold, and
    # streamed chunks it acked): `kv` holds only the rest.
    held_blocks: Count = 0
    output_token_ids: list[TokenId]  # tokens already produced (the first one, by prefill)
    emitted_text: str = ""  # text already streamed, so decode continues the same detokenization
    events_sent: Count = 0  # next TokenEvent index
    cached_tokens: Count = 0  # prompt tokens prefill found in its prefix cache
    first_token_time: Seconds = 0.0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenEvent(Message):
    """A piece of one request's output stream. `index` orders events from different senders."""

    request_id: RequestId
    index: Count
    token_ids: list[TokenId] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # positions 1.. of the prompt, first event
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ErrorBody | None = None
    instance_id: str = ""
    sent_at: float = 0.0
    # Decode's first event: KV bytes it fetched, prompt tokens it held already (reuse).
    handoff_bytes: Count | None = None
    handoff_held_tokens: Count | None = None


class KVEventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class KVEvent(Message):
    kind: KVEventKind
    instance_id: InstanceId
    tier: Literal["dram", "disk"] = "dram"
    block_hashes: list[Hash64] = Field(default_factory=list)
    block_nbytes: Count = 0
    sent_at: Seconds = 0.0


class KVExportRequest(Message):
    """Ask an instance to offer the cached blocks of a prefix on its data plane."""

    block_hashes: list[Hash64]


class KVExportReply(Message):
    handle: KVHandle
    num_blocks: int


class CancelRequest(Message):
    request_id: RequestId
    reason: str = "client disconnected"
