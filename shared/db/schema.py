"""Tables. Changes here need an Alembic migration in migrations/versions."""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import JSON, BigInteger, Float, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class RequestStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


TERMINAL_STATUSES = frozenset(
    {RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.REJECTED}
)


class RequestRecord(Base):
    """One row per request; it ends in exactly one terminal status."""

    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    tenant: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(16), index=True)
    arrival_time: Mapped[float] = mapped_column(Float, index=True)  # unix seconds
    first_token_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    finish_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    max_tokens: Mapped[int] = mapped_column(Integer, default=0)
    stream: Mapped[bool] = mapped_column(default=False)
    prefill_instance: Mapped[str | None] = mapped_column(String(128), nullable=True)
    decode_instance: Mapped[str | None] = mapped_column(String(128), nullable=True)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    e2e_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Phase boundaries the gateway measures (its clock): the placement reply (the job is on
    # a prefill queue), and the first token from a decode instance other than the prefill
    # one (the KV handoff is done). NULL where not measured: older rows, colocated decode.
    dispatch_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    decode_first_token_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The KV bytes decode fetched for the request (streamed chunks included), and the prompt
    # tokens whose KV it held already and did not fetch (decode-side reuse). NULL: no handoff.
    handoff_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    handoff_held_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)


class InstanceRecord(Base):
    """Every service instance seen on the bus, with its latest heartbeat."""

    __tablename__ = "instances"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(16), index=True)
    host: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(16))  # ready | draining | dead
    started_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float)
    info: Mapped[dict] = mapped_column(JSON, default=dict)


class KVBlockRecord(Base):
    """Cache metadata: one row per (block, instance, tier) the KV manager knows of."""

    __tablename__ = "kv_blocks"

    block_hash: Mapped[int] = mapped_column(
        BigInteger, primary_key=True
    )  # shared.hashing.to_signed
    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True, index=True)
    tier: Mapped[str] = mapped_column(String(8), primary_key=True)
    nbytes: Mapped[int] = mapped_column(Integer)
    created: Mapped[float] = mapped_column(Float)
    last_access: Mapped[float] = mapped_column(Float)
    hit_count: Mapped[int] = mapped_column(Integer, default=0)


class ReplicationRecord(Base):
    """One hot-prefix replication the conductor ordered: a prefix's blocks copied from one
    prefill instance to another, because more requests hit it than its holders carry."""

    __tablename__ = "kv_replications"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created: Mapped[float] = mapped_column(Float, index=True)  # unix seconds
    prefix_hash: Mapped[int] = mapped_column(BigInteger)  # the last block's; to_signed
    blocks: Mapped[int] = mapped_column(Integer)  # copied
    nbytes: Mapped[int] = mapped_column(BigInteger)  # copied
    source: Mapped[str] = mapped_column(String(128))  # instance id copied from
    target: Mapped[str] = mapped_column(String(128))  # instance id copied to
    heat_rps: Mapped[float] = mapped_column(Float)  # the prefix's hit rate, requests/s
    holders: Mapped[int] = mapped_column(Integer)  # prefill instances holding it before
    reason: Mapped[str] = mapped_column(Text, default="")


class DecisionRecord(Base):
    """Why the conductor placed (or refused) a request: every candidate's predictions."""

    __tablename__ = "decisions"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created: Mapped[float] = mapped_column(Float, index=True)
    policy: Mapped[str] = mapped_column(String(32))
    prefill_instance: Mapped[str | None] = mapped_column(String(128), nullable=True)
    decode_instance: Mapped[str | None] = mapped_column(String(128), nullable=True)
    predicted_ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    predicted_tbt_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    rejected: Mapped[str | None] = mapped_column(Text, nullable=True)
    candidates: Mapped[list] = mapped_column(JSON, default=list)


class LoadSample(Base):
    """One prefill/decode instance's load, sampled by the conductor from its heartbeats:
    at most one row per instance per sampling interval (`t` is the interval's start, so
    conductors that sample the same heartbeats write the same key). Activity columns count
    what happened since the previous sample (NULL: unknown, e.g. after a conductor restart).
    """

    __tablename__ = "load_samples"

    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    t: Mapped[float] = mapped_column(Float, primary_key=True, index=True)  # unix seconds
    role: Mapped[str] = mapped_column(String(16))
    interval_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # since the last one
    queue_depth: Mapped[int] = mapped_column(Integer, default=0)
    running: Mapped[int] = mapped_column(Integer, default=0)
    kv_blocks_used: Mapped[int] = mapped_column(Integer, default=0)  # DRAM tier, in sequences
    kv_blocks_free: Mapped[int] = mapped_column(Integer, default=0)  # (free may still cache)
    kv_blocks_cached: Mapped[int] = mapped_column(Integer, default=0)
    disk_blocks_used: Mapped[int] = mapped_column(Integer, default=0)
    disk_blocks_free: Mapped[int] = mapped_column(Integer, default=0)
    blocks_stored: Mapped[int | None] = mapped_column(Integer, nullable=True)
    blocks_evicted: Mapped[int | None] = mapped_column(Integer, nullable=True)
    disk_stored: Mapped[int | None] = mapped_column(Integer, nullable=True)
    disk_removed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    transfers_in: Mapped[int | None] = mapped_column(Integer, nullable=True)
    transfers_out: Mapped[int | None] = mapped_column(Integer, nullable=True)
    bytes_in: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    bytes_out: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class ApiKeyRecord(Base):
    """An API key for the gateway. Only the SHA-256 of the secret is kept: the plaintext is
    shown once, when the key is created, and a leaked table gives no usable key."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public: list, revoke
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    prefix: Mapped[str] = mapped_column(String(16))  # the secret's first characters, to spot it
    name: Mapped[str] = mapped_column(String(200), default="")
    tenant: Mapped[str] = mapped_column(String(200), index=True)  # also the prefix-cache salt
    admin: Mapped[bool] = mapped_column(default=False)  # reaches /admin/*, not /v1/*
    rate_limit: Mapped[str] = mapped_column(String(100), default="")  # `limits` syntax; "": none
    created: Mapped[float] = mapped_column(Float)
    revoked: Mapped[float | None] = mapped_column(Float, nullable=True)


class PlanDecisionRecord(Base):
    """One decision of the P/D planner (services/conductor/planner.py, decision_record):
    the split it saw, the split it predicts best, the switch it made (active mode) or would
    make (advisory), and what it weighed. `estimates` hold None where a prediction is inf."""

    __tablename__ = "plan_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created: Mapped[float] = mapped_column(Float, index=True)  # unix seconds
    mode: Mapped[str] = mapped_column(String(16))  # off | advisory | active
    current_prefill: Mapped[int] = mapped_column(Integer)
    current_decode: Mapped[int] = mapped_column(Integer)
    best_prefill: Mapped[int] = mapped_column(Integer)
    best_decode: Mapped[int] = mapped_column(Integer)
    switch_instance: Mapped[str | None] = mapped_column(String(128), nullable=True)
    switch_from: Mapped[str | None] = mapped_column(String(16), nullable=True)
    switch_to: Mapped[str | None] = mapped_column(String(16), nullable=True)
    drain_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # predicted
    acted: Mapped[bool] = mapped_column(default=False)  # the switch was sent
    reason: Mapped[str] = mapped_column(Text, default="")
    attainment: Mapped[float | None] = mapped_column(Float, nullable=True)
    forecast: Mapped[dict] = mapped_column(JSON, default=dict)
    instances: Mapped[list] = mapped_column(JSON, default=list)
    estimates: Mapped[list] = mapped_column(JSON, default=list)


class RoleSwitchRecord(Base):
    """One engine instance moved to another role in place, asked by an admin or the planner:
    written when it starts draining, then updated once it is done (or failed); a request
    refused up front is written once, as refused."""

    __tablename__ = "role_switches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the switch id
    instance_id: Mapped[str] = mapped_column(String(128), index=True)
    from_role: Mapped[str] = mapped_column(String(16))
    to_role: Mapped[str] = mapped_column(String(16))
    source: Mapped[str] = mapped_column(String(16))  # admin | planner
    status: Mapped[str] = mapped_column(String(16))  # draining | done | refused | failed
    requested_at: Mapped[float] = mapped_column(Float, index=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    drain_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # measured
    # Why it was refused or failed, or what the drain waited for ("3 sequences finished").
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)


Index("ix_requests_status_arrival", RequestRecord.status, RequestRecord.arrival_time)
