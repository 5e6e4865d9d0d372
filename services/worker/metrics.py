"""Prometheus metrics of a prefill or decode instance (served on its `metrics_port`).

State (queues, KV pool, running totals the engine and the instance already keep) is read
at scrape time; only step times and transfer times are observed as they happen, through
the engine's `on_step` hook and the transports' `on_end` hook, so the engine loop and the
handlers carry no metrics code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import Counter, Histogram
from prometheus_client.core import Metric

from shared.engine.llm_engine import EngineStats, StepStats
from shared.kv_load import KINDS, OUTCOMES
from shared.messages import KVActivity
from shared.metrics import FAST_BUCKETS, ScrapeCollector, counter, gauge, new_registry
from shared.transfer.base import TransferState

if TYPE_CHECKING:
    from services.worker.instance import EngineInstance
    from shared.transfer import KVReceiver, KVSender


class EngineMetrics:
    def __init__(self, inst: EngineInstance) -> None:
        self.inst = inst
        self.registry = r = new_registry()
        self.step_seconds = Histogram(
            "halfmoon_engine_step_seconds",
            "Wall time of one engine step (one forward pass)",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.step_tokens = Counter(
            "halfmoon_engine_step_tokens",
            "Tokens computed by engine steps (prompt chunks + decodes)",
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "halfmoon_kv_transfer_seconds",
            "Completed KV transfers: receiving side from fetch "
            "to done, sending side from offer to done (includes the wait for the receiver)",
            ["direction", "purpose"],
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.transfer_failures = Counter(
            "halfmoon_kv_transfer_failures",
            "KV transfers that ended failed or expired",
            ["direction", "purpose"],
            registry=r,
        )
        r.register(ScrapeCollector(self.collect))
        inst.engine.on_step = self.on_step
        self.watch_transfers(getattr(inst, "sender", None), getattr(inst, "receiver", None))

    def watch_transfers(self, sender: KVSender | None, receiver: KVReceiver | None) -> None:
        for direction, end in (("out", sender), ("in", receiver)):
            if end is not None:
                end.states.on_end = self._transfer_ended(direction)

    def _transfer_ended(self, direction: str) -> Callable[[str, TransferState, float, str], None]:
        # The purpose comes from the offer (or fetch) that labelled it: transfer ids are
        # random capabilities and say nothing.
        def ended(transfer_id: str, state: TransferState, seconds: float, purpose: str) -> None:
            if state == TransferState.DONE:
                self.transfer_seconds.labels(direction, purpose).observe(seconds)
            else:
                self.transfer_failures.labels(direction, purpose).inc()

        return ended

    def on_step(self, step: StepStats) -> None:
        """Engine thread: prometheus_client's metrics take their own locks."""
        self.step_seconds.observe(step.seconds)
        self.step_tokens.inc(step.num_tokens)

    def collect(self) -> Iterable[Metric]:
        inst = self.inst
        s = inst.stats  # the snapshot taken after each step: safe to read off-thread
        yield gauge(
            "halfmoon_engine_info",
            "This instance (value 1)",
            labels=("instance_id", "role", "model"),
            samples=[((inst.instance_id, inst.role.value, inst.lm.name), 1)],
        )
        yield gauge(
            "halfmoon_engine_waiting_requests", "Requests queued for their prompt", float(s.waiting)
        )
        yield gauge(
            "halfmoon_engine_running_requests", "Sequences in the running batch", float(s.running)
        )
        queue = getattr(inst, "queue", None)  # decode: handoffs waiting for pool room
        if queue is not None:
            yield gauge(
                "halfmoon_engine_pending_imports",
                "Decode: handoffs waiting for room in the pool (not fetched yet)",
                float(len(queue)),
            )
        yield from self._kv_families(s)
        yield counter(
            "halfmoon_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (local, disk or pulled blocks)",
            s.prefix_hit_tokens,
        )
        yield counter(
            "halfmoon_prefix_cache_miss_tokens", "Prompt tokens computed", s.prefix_miss_tokens
        )
        yield counter(
            "halfmoon_engine_preemptions", "Sequences preempted for KV room", s.preemptions
        )
        yield counter(
            "halfmoon_spec_draft_tokens",
            "Speculative tokens proposed by prompt lookup (decode steps with drafts)",
            s.spec_draft_tokens,
        )
        yield counter(
            "halfmoon_spec_accepted_tokens",
            "Speculative tokens the model kept (acceptance rate: over the drafted ones)",
            s.spec_accepted_tokens,
        )
        yield counter(
            "halfmoon_kv_evicted_blocks",
            "DRAM-tier blocks evicted from the cache",
            s.evicted_blocks,
        )
        yield from self._transfer_families()

    def _transfer_families(self) -> Iterable[Metric]:
        inst = self.inst
        a = inst.kv_activity
        yield counter(
            "halfmoon_kv_transfer_bytes",
            "KV bytes moved by completed transfers",
            labels=("direction",),
            samples=[(("in",), a.bytes_in), (("out",), a.bytes_out)],
        )
        yield counter(
            "halfmoon_kv_transfers",
            "Completed KV transfers",
            labels=("direction",),
            samples=[(("in",), a.transfers_in), (("out",), a.transfers_out)],
        )
        yield from _handoff_families(a)
        failures = inst.engine.kv_load_failures
        yield counter(
            "halfmoon_kv_load_failures",
            f"KV loads that failed (a prefix pull, a handoff, a disk read) by what followed: "
            f"recomputed, or the request failed (this instance's policy: {failures.policy})",
            labels=("kind", "outcome"),
            samples=[((k, o), failures.counts[k, o]) for k in KINDS for o in OUTCOMES],
        )
        sender = getattr(inst, "sender", None)
        if sender is not None:
            yield counter(
                "halfmoon_kv_transfer_refused",
                "Data-plane requests this sender "
                "refused: unknown, used, expired or withdrawn transfer ids, or "
                "malformed requests (a run of them from one peer is also logged)",
                sender.refusals.total,
            )
        receiver = getattr(inst, "receiver", None)
        if receiver is not None:
            yield counter(
                "halfmoon_kv_transfer_bad_frames",
                "Frames this receiver refused: another protocol, a size past the bound or "
                "not the offer's, a wrong checksum, a frame cut short (a buggy or hostile "
                "sender, or version skew)",
                receiver.bad_frames,
            )

    def _kv_families(self, s: EngineStats) -> Iterable[Metric]:
        engine = self.inst.engine
        total, free = s.kv_blocks_total, s.kv_blocks_free
        block_nbytes = engine.kv.shape.block_nbytes
        blocks = [(("dram", "used"), total - free), (("dram", "free"), free)]
        cached = [(("dram",), s.kv_blocks_cached)]
        used_bytes = [(("dram",), (total - free) * block_nbytes)]
        capacity = [(("dram",), engine.kv.nbytes)]
        disk = engine.disk
        if disk is not None:
            n, disk_free = self.inst.disk_blocks()
            blocks += [(("disk", "used"), n), (("disk", "free"), disk_free)]
            cached.append((("disk",), n))
            used_bytes.append((("disk",), disk.nbytes))
            capacity.append((("disk",), disk.capacity_bytes))
        yield gauge(
            "halfmoon_kv_blocks",
            "KV blocks by tier and state (used: held by sequences in DRAM, stored on disk)",
            labels=("tier", "state"),
            samples=blocks,
        )
        yield gauge(
            "halfmoon_kv_cached_blocks",
            "Blocks registered in the prefix cache (in use or free)",
            labels=("tier",),
            samples=cached,
        )
        yield gauge(
            "halfmoon_kv_used_bytes",
            "KV bytes in use by tier",
            labels=("tier",),
            samples=used_bytes,
        )
        yield gauge(
            "halfmoon_kv_capacity_bytes", "KV capacity by tier", labels=("tier",), samples=capacity
        )


def _handoff_families(a: KVActivity) -> Iterable[Metric]:
    """What handoffs moved and decode held, and the hot-prefix copies a prefill took in."""
    yield counter(
        "halfmoon_kv_handoffs",
        "Handoffs whose KV this decode instance fetched",
        a.handoffs,
    )
    yield counter(
        "halfmoon_kv_handoff_bytes",
        "KV bytes those handoffs moved (streamed chunks included)",
        a.handoff_bytes,
    )
    yield counter(
        "halfmoon_kv_handoff_held_bytes",
        "KV bytes of those handoffs' prompts this pool held already and did not fetch "
        "(decode-side reuse)",
        a.handoff_held_bytes,
    )
    yield counter(
        "halfmoon_kv_replicas",
        "Hot prefixes copied into this prefill instance ahead of demand",
        a.replicas,
    )
    yield counter(
        "halfmoon_kv_replica_bytes",
        "KV bytes those copies moved",
        a.replica_bytes,
    )
