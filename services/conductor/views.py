"""What the placement policies see and decide (pure data): a snapshot of the cluster, the
request, each candidate's predicted times and the decision (policy.py says how it is made)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.conductor.costmodel import CostModel
from services.conductor.pipeline import StageTime


@dataclass(slots=True)  # built per instance per decision: keep construction cheap
class InstanceView:
    instance_id: str
    queue_s: float = 0.0  # predicted seconds of work ahead of a new request
    running: int = 0  # decode: sequences in the batch
    mean_context: float = 0.0  # decode: average tokens per running sequence
    load: int = 0  # queued + running requests (for least_loaded)
    # decode: KV blocks it can still give a new request (free, less those promised to
    # requests dispatched since its report); None when unknown: assumed to have room.
    kv_blocks_free: int | None = None


@dataclass(frozen=True)
class RequestView:
    request_id: str
    prompt_tokens: int
    prefix_blocks: dict[str, int]  # instance -> cached leading blocks of this prompt
    ttft_slo_s: float
    tbt_slo_s: float
    max_tokens: int = 0  # output tokens it may generate: their KV must fit on decode too
    # instance -> of its cached leading blocks, those on its disk tier only (read back
    # before reuse; never pulled: an export comes from DRAM)
    disk_blocks: dict[str, int] = field(default_factory=dict)
    # decode instance -> leading blocks of this prompt its cache holds: a handoff there
    # moves only the rest (decode-side reuse)
    decode_blocks: dict[str, int] = field(default_factory=dict)
    # The leading run of its blocks the KV manager counts as hot, and that run's hits a
    # second (replication.py copies a hot prefix to more holders)
    hot_blocks: int = 0
    heat_rps: float = 0.0


@dataclass(slots=True)
class Candidate:
    instance_id: str
    prefix_blocks: int  # blocks reused (own or pulled)
    pull_from: str  # "" when the instance's own cache is used
    transfer_s: float
    queue_s: float
    prefill_s: float
    overhead_s: float = 0.0
    # A pipelined prefill: (instance, its layers and times) per stage, in pipeline order,
    # the first being `instance_id`; empty for a single instance.
    stages: tuple[tuple[str, StageTime], ...] = ()
    # Its own prefix's blocks on its disk tier: read back (disk_s, in the TTFT) or, when
    # that is slower than computing them, left there and computed (`disk_skipped`).
    disk_blocks: int = 0
    disk_s: float = 0.0
    disk_skipped: bool = False

    @property
    def ttft_s(self) -> float:
        return self.overhead_s + self.transfer_s + self.disk_s + self.queue_s + self.prefill_s


@dataclass
class Decision:
    policy: str
    prefill: Candidate | None = None
    decode_id: str = ""
    tbt_s: float = 0.0
    candidates: list[Candidate] = field(default_factory=list)
    rejected: str = ""  # why, when the request is refused
    decode_blocks: int = 0  # KV blocks the request takes on decode (reserved at dispatch)

    @property
    def ttft_s(self) -> float:
        return self.prefill.ttft_s if self.prefill else 0.0


@dataclass
class Snapshot:
    prefills: list[InstanceView]
    decodes: list[InstanceView]
    cost: CostModel
    balancing_threshold: float = 1.5  # pull when the best holder has this many times more
    slo_margin: float = 1.0  # admit only predictions within this share of the SLO
    colocated: bool = False  # each instance decodes what it prefills (decodes == prefills)
    # Colocated instances in a disaggregated pool (prefills that decode their own requests;
    # services/worker/roles.py): each one's batch, by id. They are among `prefills`, never
    # among `decodes`: no other instance hands them KV.
    own_decodes: dict[str, InstanceView] = field(default_factory=dict)
    # Pipelined prefill (kvcentric): groups of up to max_stages instances (1: none), for
    # prompts of at least pipeline_min_tokens (0: only those no instance serves in time).
    max_stages: int = 1
    pipeline_min_tokens: int = 0
