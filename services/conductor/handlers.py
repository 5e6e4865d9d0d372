"""Conductor handlers: heartbeats in, placement + dispatch out, instance rows to SQL."""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import bus, errors, subjects
from shared.db.records import RecordWriter
from shared.messages import (Ack, GenerateRequest, InstanceInfo, KVMatchReply, KVMatchRequest,
                             Placement, PrefillJob, Role)
from services.conductor.args import ConductorSettings
from services.conductor.placement import make_policy
from services.conductor.registry import InstanceState, Registry

log = logging.getLogger(__name__)


class Conductor:
    def __init__(self, settings: ConductorSettings, nc: NATS, records: RecordWriter | None) -> None:
        self.settings = settings
        self.nc = nc
        self.records = records
        self.registry = Registry(settings.heartbeat_expiry_s)
        self.prefill_policy = make_policy(settings.policy)
        self.decode_policy = make_policy(settings.policy)
        self._recorded_at: dict[str, float] = {}

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            info = InstanceInfo.model_validate_json(msg.data)
        except ValueError:
            log.warning("malformed heartbeat on %s", msg.subject)
            return
        now = time.time()
        if self.registry.seen(info, now):
            log.info("instance %s (%s) is up", info.instance_id, info.role)
        self._record_instance(info, now, info.status)

    def _record_instance(self, info: InstanceInfo, now: float, status: str) -> None:
        last = self._recorded_at.get(info.instance_id)
        if self.records is None or (last is not None and status != "dead"
                                    and now - last < self.settings.instance_record_interval_s):
            return
        self._recorded_at[info.instance_id] = now
        self.records.instance_seen(id=info.instance_id, role=info.role.value, host=info.host,
                                   status=status, started_at=info.started_at,
                                   last_heartbeat=now, info=info.model_dump(mode="json"))

    def sweep(self) -> None:
        """Mark instances dead in SQL once their heartbeats stop."""
        now = time.time()
        for state in self.registry.expire(now):
            if self._recorded_at.pop(state.info.instance_id, None) is not None:
                log.warning("instance %s missed heartbeats: dead", state.info.instance_id)
                if self.records is not None:
                    self.records.instance_seen(id=state.info.instance_id, status="dead")

    async def on_schedule(self, msg: Msg) -> None:
        try:
            req = GenerateRequest.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad schedule request: {exc}"))
            return
        try:
            placement = await self.place(req)
        except errors.HalfmoonError as exc:
            log.warning("request %s not placed: %s", req.request_id, exc.message)
            await bus.respond(msg, exc)
            return
        await bus.respond(msg, placement)

    async def place(self, req: GenerateRequest) -> Placement:
        now = time.time()
        decodes = self.decode_policy.rank(self.registry.alive(Role.DECODE, now))
        prefills = self.prefill_policy.rank(self.registry.alive(Role.PREFILL, now))
        if not decodes or not prefills:
            raise errors.Unavailable("no live prefill and decode instances", retry_after_s=2.0)
        decode = decodes[0]
        matches = await self._prefix_matches(req)
        last_error: errors.HalfmoonError | None = None
        for prefill in prefills:
            try:
                await self._dispatch(req, prefill, decode, matches, prefills)
            except errors.HalfmoonError as exc:
                log.warning("request %s: prefill %s refused: %s", req.request_id,
                            prefill.info.instance_id, exc.message)
                last_error = exc
                continue
            self.registry.dispatched(decode.info.instance_id)
            return Placement(request_id=req.request_id, prefill_id=prefill.info.instance_id,
                             decode_id=decode.info.instance_id, policy=self.prefill_policy.name)
        assert last_error is not None
        raise last_error

    async def _prefix_matches(self, req: GenerateRequest) -> dict[str, int]:
        """Cached prefix length (blocks) per instance, from the KV manager; {} if it is away."""
        if not req.block_hashes:
            return {}
        try:
            reply = await bus.request(self.nc, subjects.KV_MATCH,
                                      KVMatchRequest(block_hashes=req.block_hashes), KVMatchReply,
                                      timeout_s=self.settings.kv_match_timeout_s)
        except errors.HalfmoonError as exc:
            log.debug("request %s: no prefix match (%s)", req.request_id, exc.message)
            return {}
        return reply.matches

    def _pull_hint(self, prefill: InstanceState, matches: dict[str, int],
                   prefills: list[InstanceState]) -> tuple[str, int]:
        """Where to pull prefix blocks from, if another prefill holds clearly more of it."""
        local = matches.get(prefill.info.instance_id, 0)
        holders = [(matches.get(p.info.instance_id, 0), p.info.instance_id) for p in prefills
                   if p is not prefill]
        best, holder = max(holders, default=(0, ""))
        if best - local >= self.settings.min_pull_blocks:
            return holder, best
        return "", 0

    async def _dispatch(self, req: GenerateRequest, prefill: InstanceState,
                        decode: InstanceState, matches: dict[str, int],
                        prefills: list[InstanceState]) -> None:
        source, blocks = self._pull_hint(prefill, matches, prefills)
        job = PrefillJob(request=req, decode_id=decode.info.instance_id, prefix_from=source,
                         prefix_blocks=blocks)
        await bus.request(self.nc, subjects.prefill_submit(prefill.info.instance_id), job, Ack,
                          timeout_s=self.settings.dispatch_timeout_s)
        self.registry.dispatched(prefill.info.instance_id)
