"""Conductor handlers: heartbeats in, placement + dispatch out, instance rows to SQL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.conductor import snapshot
from services.conductor.args import ConductorSettings, planner_settings, replication_settings
from services.conductor.calibration import Calibrator
from services.conductor.costmodel import CostModel, load_cost_model, prior_for
from services.conductor.metrics import ConductorMetrics
from services.conductor.planning import PlannerLoop
from services.conductor.policy import follow, make_policy
from services.conductor.registry import InstanceState, Registry
from services.conductor.replicas import Replicas
from services.conductor.roles import RoleSwitches
from services.conductor.views import Candidate, Decision, RequestView, Snapshot
from shared import bus, errors, subjects
from shared.db.records import RecordWriter
from shared.groups import holder_alive
from shared.kv_messages import KVMatchReply, KVMatchRequest
from shared.messages import (
    Ack,
    GenerateRequest,
    InstanceInfo,
    Placement,
    PrefillJob,
    Role,
    StageClose,
    StageJob,
    StageOpened,
    StageRef,
)

log = logging.getLogger(__name__)


class Conductor:
    def __init__(self, settings: ConductorSettings, nc: NATS, records: RecordWriter | None) -> None:
        self.settings = settings
        self.nc = nc
        self.records = records
        self.registry = Registry(settings.heartbeat_expiry_s)
        self.metrics = ConductorMetrics(self.registry)
        self.policy = make_policy(settings.policy)
        # Online: refit from the costs engines report, starting from a prior chosen by the
        # first engine's key (its profiled fit, else the built-in defaults).
        self.calibrator = Calibrator(load_cost_model(settings.cost_model))
        self._prior_key: str | None = None
        self._recorded_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Active/standby: whether this conductor still holds the leader lease (see leader.py).
        self.leading: Callable[[], bool] = lambda: True
        self.roles = RoleSwitches(self)
        self.planning = PlannerLoop(self, self.roles, planner_settings(settings))
        self.replicas = Replicas(
            replication_settings(settings), nc, records, self.metrics, time.time()
        )

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            info = InstanceInfo.model_validate_json(msg.data)
        except ValueError:
            log.warning("malformed heartbeat on %s", msg.subject)
            return
        now = time.time()
        if self.registry.seen(info, now):
            log.info("instance %s (%s) is up", info.instance_id, info.role)
        self.roles.on_beat(info)
        self._calibrate(info)
        self._record_instance(info, now, info.status)

    @property
    def cost(self) -> CostModel:
        return self.calibrator.model()

    def _calibrate(self, info: InstanceInfo) -> None:
        if info.engine_key and self._prior_key is None:
            self._prior_key = info.engine_key
            prior = prior_for(info.engine_key, self.settings.cost_model)
            self.calibrator = Calibrator(prior)
            log.info("cost model prior for %s: %s", info.engine_key, prior.source)
        if info.cost_samples:
            self.calibrator.observe(info.cost_samples)

    def _record_instance(self, info: InstanceInfo, now: float, status: str) -> None:
        if self.records is None:
            return
        if info.role in (Role.PREFILL, Role.DECODE):
            s = self.settings
            self.records.load_sample(
                info, now, s.instance_record_interval_s, s.load_retention_s, s.request_retention_s
            )
        last = self._recorded_at.get(info.instance_id)
        if (
            last is not None
            and status != "dead"
            and now - last < self.settings.instance_record_interval_s
        ):
            return
        self._recorded_at[info.instance_id] = now
        self.records.instance_seen(
            id=info.instance_id,
            role=info.role.value,
            host=info.host,
            status=status,
            started_at=info.started_at,
            last_heartbeat=now,
            info=info.model_dump(mode="json"),
        )

    def sweep(self) -> None:
        """Mark instances dead in SQL once their heartbeats stop."""
        now = time.time()
        for state in self.registry.expire(now):
            self.roles.on_dead(state.info.instance_id)
            if self._recorded_at.pop(state.info.instance_id, None) is not None:
                log.warning("instance %s missed heartbeats: dead", state.info.instance_id)
                if self.records is not None:
                    self.records.instance_seen(id=state.info.instance_id, status="dead")

    async def on_schedule(self, msg: Msg) -> None:
        # One task per request: a placement waiting on a slow prefill ack must not hold up
        # the next decision (nats-py runs a subscription's callbacks one at a time).
        task = asyncio.create_task(self._schedule(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _schedule(self, msg: Msg) -> None:
        try:
            req = GenerateRequest.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad schedule request: {exc}"))
            return
        t0 = time.perf_counter()
        try:
            placement = await self.place(req)
        except errors.HalfmoonError as exc:
            log.warning("request %s not placed: %s", req.request_id, exc.message)
            self.metrics.rejected(exc.code, time.perf_counter() - t0)
            await bus.respond(msg, exc)
            return
        except Exception:  # a fault here still answers: never leave the gateway waiting
            log.exception("request %s: placing it failed", req.request_id)
            self.metrics.rejected("internal_error", time.perf_counter() - t0)
            await bus.respond(msg, errors.HalfmoonError("the conductor failed to place it"))
            return
        self.metrics.placed(placement.policy, time.perf_counter() - t0)
        await bus.respond(msg, placement)

    async def place(self, req: GenerateRequest) -> Placement:
        now = time.time()
        prefills = self.registry.alive(Role.PREFILL, now)
        colocated = self.settings.layout == "colocated"
        decodes = prefills if colocated else self.registry.alive(Role.DECODE, now)
        if not decodes:  # only colocated instances (those in the pool) can serve it whole
            prefills = [p for p in prefills if p.info.colocated]
        if not prefills:
            raise errors.Unavailable("no live prefill and decode instances", retry_after_s=2.0)
        view = await self._request_view(req, prefills, decodes)
        self.planning.note(req, view.prefix_blocks, now)
        while True:
            snap = self._snapshot(prefills, decodes, colocated)
            t_decide = time.perf_counter()
            decision = follow(
                self.policy.name, snap, view, req.follow_prefill
            ) or self.policy.decide(snap, view)
            self.metrics.decision_seconds.observe(time.perf_counter() - t_decide)
            if decision.rejected:
                self._record(req, decision, now)
                retry = max(1.0, decision.ttft_s - view.ttft_slo_s)
                raise errors.Rejected(
                    f"rejected: {decision.rejected}", code="slo_unattainable", retry_after_s=retry
                )
            assert decision.prefill is not None
            if not self.leading():
                # Deposed while deciding: another conductor may be placing by now. Nothing
                # was dispatched, so the gateway can safely ask the new leader.
                raise errors.Unavailable(
                    "this conductor lost the leader lease", code="not_leader", retry_after_s=1.0
                )
            try:
                await self._dispatch(req, decision)
                break
            except errors.HalfmoonError as exc:
                # That instance refused or is gone: decide again without it.
                chosen = decision.prefill.instance_id
                log.warning(
                    "request %s: prefill %s refused: %s", req.request_id, chosen, exc.message
                )
                prefills = [p for p in prefills if p.info.instance_id != chosen]
                if not prefills:
                    raise
        self._record(req, decision, now)
        await self.replicas.consider(req, view, snap, now)
        return Placement(
            request_id=req.request_id,
            prefill_id=decision.prefill.instance_id,
            decode_id=decision.decode_id,
            policy=decision.policy,
            predicted_ttft_ms=decision.ttft_s * 1e3,
        )

    async def _request_view(
        self, req: GenerateRequest, prefills: list[InstanceState], decodes: list[InstanceState]
    ) -> RequestView:
        """The request as the policies see it: its prefix cached on each live holder (an
        instance, or a group all of whose stages are alive), of it, on disk, and on each
        decode instance (which a handoff there need not move)."""
        live = {p.info.instance_id for p in prefills}
        decoding = {d.info.instance_id for d in decodes} - live
        reply = await self._prefix_matches(req)
        matches = {k: v for k, v in reply.matches.items() if holder_alive(k, live)}
        return snapshot.request_view(
            req,
            matches,
            self.settings.ttft_slo_ms / 1e3,
            self.settings.tbt_slo_ms / 1e3,
            {k: v for k, v in reply.on_disk.items() if k in matches},
            {k: v for k, v in reply.matches.items() if k in decoding},
            (reply.hot_blocks, reply.heat_rps),
        )

    def _snapshot(
        self, prefills: list[InstanceState], decodes: list[InstanceState], colocated: bool
    ) -> Snapshot:
        s = self.settings
        return snapshot.build(
            prefills,
            decodes,
            self.cost,
            s.balancing_threshold,
            s.slo_margin,
            colocated,
            s.max_stages,
            s.pipeline_min_tokens,
        )

    def _record(self, req: GenerateRequest, d: Decision, now: float) -> None:
        if self.records is None:
            return
        self.records.decision(
            request_id=req.request_id,
            created=now,
            policy=d.policy,
            prefill_instance=d.prefill.instance_id if d.prefill and not d.rejected else None,
            decode_instance=d.decode_id or None,
            rejected=d.rejected or None,
            predicted_ttft_ms=d.ttft_s * 1e3 if d.prefill else None,
            # a decode instance's, or a colocated one's own batch (inf: no room anywhere)
            predicted_tbt_ms=d.tbt_s * 1e3 if 0 < d.tbt_s < math.inf else None,
            candidates=[
                {
                    "instance": c.instance_id,
                    "prefix_blocks": c.prefix_blocks,
                    "pull_from": c.pull_from,
                    "transfer_ms": c.transfer_s * 1e3,
                    "queue_ms": c.queue_s * 1e3,
                    "prefill_ms": c.prefill_s * 1e3,
                    "ttft_ms": c.ttft_s * 1e3,
                    **({"stages": stage_record(c)} if c.stages else {}),
                    **(disk_record(c) if c.disk_blocks else {}),
                }
                for c in d.candidates
            ],
        )

    async def _prefix_matches(self, req: GenerateRequest) -> KVMatchReply:
        """Cached prefix length (blocks) per instance, and of it on disk, from the KV
        manager; none if it is away."""
        if not req.block_hashes:
            return KVMatchReply()
        try:
            return await bus.request(
                self.nc,
                subjects.KV_MATCH,
                KVMatchRequest(block_hashes=req.block_hashes),
                KVMatchReply,
                timeout_s=self.settings.kv_match_timeout_s,
            )
        except errors.HalfmoonError as exc:
            log.debug("request %s: no prefix match (%s)", req.request_id, exc.message)
            return KVMatchReply()

    async def _dispatch(self, req: GenerateRequest, d: Decision) -> None:
        assert d.prefill is not None
        if d.prefill.stages:
            await self._dispatch_group(req, d)
            return
        job = prefill_job(req, d)
        # Count the work before awaiting the ack, so decisions made meanwhile see it.
        self._account(req, d, +1)
        try:
            await bus.request(
                self.nc,
                subjects.prefill_submit(d.prefill.instance_id),
                job,
                Ack,
                timeout_s=self.settings.dispatch_timeout_s,
            )
        except errors.HalfmoonError:
            self._account(req, d, -1)
            raise

    async def _dispatch_group(self, req: GenerateRequest, d: Decision) -> None:
        """A pipelined prefill: each stage opened, the last first, so stage 0 (which starts
        computing at once) finds the rest ready. If one refuses, those opened are closed
        and the refusal goes up: the request is decided again without the group's first.
        A stage that did not answer in time is closed too: it may still open the prompt."""
        jobs = stage_jobs(req, d, self.cost.block_size)
        self._account(req, d, +1)
        opened: list[StageJob] = []
        try:
            for job in reversed(jobs):
                try:
                    await bus.request(
                        self.nc,
                        subjects.prefill_stage(job.me.instance_id),
                        job,
                        StageOpened,
                        timeout_s=self.settings.stage_open_timeout_s,
                    )
                except errors.Timeout:
                    opened.append(job)  # silent, not refused: it may open it yet
                    raise
                opened.append(job)
        except errors.HalfmoonError:
            self._account(req, d, -1)
            for job in opened:
                with contextlib.suppress(errors.HalfmoonError):
                    await bus.request(
                        self.nc,
                        subjects.prefill_stage_close(job.me.instance_id),
                        StageClose(request_id=req.request_id),
                        Ack,
                        timeout_s=self.settings.dispatch_timeout_s,
                    )
            raise

    def _account(self, req: GenerateRequest, d: Decision, sign: int) -> None:
        """Add (+1) or take back (-1) a dispatch: the prefill's predicted work (each stage's
        time held, for a group), and the decode's new sequence, its prompt tokens and the
        KV blocks it will take."""
        assert d.prefill is not None
        if d.prefill.stages:
            for instance_id, t in d.prefill.stages:
                self.registry.dispatched(instance_id, sign * t.end_s, count=sign)
        else:
            self.registry.dispatched(d.prefill.instance_id, sign * d.prefill.prefill_s, count=sign)
        decode_id = d.decode_id or d.prefill.instance_id  # colocated: the same instance
        self.registry.dispatched(
            decode_id,
            tokens=sign * len(req.prompt_token_ids),
            count=sign if d.decode_id else 0,
            blocks=sign * d.decode_blocks,
        )


def disk_record(c: Candidate) -> dict[str, object]:
    """A candidate's own blocks on its disk tier, as the record shows them: read back (and
    the read's predicted time), or left there and computed, and why."""
    if not c.disk_skipped:
        return {"disk_blocks": c.disk_blocks, "disk_ms": c.disk_s * 1e3}
    why = "reading them back is predicted slower than computing them"
    return {"disk_blocks": c.disk_blocks, "disk_ms": None, "disk": f"recomputed: {why}"}


def stage_record(c: Candidate) -> list[dict[str, object]]:
    """A group's stages as the decision record shows them: who, which layers, when."""
    return [
        {
            "instance": instance_id,
            "layers": list(t.layers),
            "start_ms": t.start_s * 1e3,
            "end_ms": t.end_s * 1e3,
        }
        for instance_id, t in c.stages
    ]


def stage_jobs(req: GenerateRequest, d: Decision, block_size: int) -> list[StageJob]:
    """The jobs that carry out a group decision: one per stage, in pipeline order, all
    starting after the prefix the group holds (never the prompt's last token)."""
    assert d.prefill is not None
    refs = [
        StageRef(instance_id=iid, first_layer=t.layers[0], end_layer=t.layers[1])
        for iid, t in d.prefill.stages
    ]
    cached = d.prefill.prefix_blocks * block_size
    last_block = (len(req.prompt_token_ids) - 1) // block_size * block_size
    start = min(cached, last_block)
    return [
        StageJob(request=req, stages=refs, index=i, decode_id=d.decode_id, start_tokens=start)
        for i in range(len(refs))
    ]


def prefill_job(req: GenerateRequest, d: Decision) -> PrefillJob:
    """The job that carries out decision `d`: its prefill pull, exactly as decided."""
    assert d.prefill is not None
    pull = d.prefill.pull_from
    return PrefillJob(
        request=req,
        decode_id=d.decode_id,
        prefix_from=pull,
        prefix_blocks=d.prefill.prefix_blocks if pull else 0,
        skip_disk=d.prefill.disk_skipped,
    )
