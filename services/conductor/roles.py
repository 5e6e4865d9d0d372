"""Role switches, as the conductor runs them: it checks each one, stops placing on the
instance, tells it to switch (services/worker/roles.py), and records the outcome. Also
the other half of a switch: a prefill whose decode refused a handoff asks here for
another decode instance (Redecode).

The check is pure (refusal) so the planner and the admin API share it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from services.conductor import snapshot
from services.conductor.policy import select_decode
from shared import bus, errors, subjects
from shared.messages import InstanceInfo, Placement, Role
from shared.role_messages import (
    EngineRole,
    Redecode,
    RoleChange,
    RoleChangeReply,
    SwitchDone,
    SwitchRole,
    engine_role,
)

if TYPE_CHECKING:
    from services.conductor.parts import ConductorParts
    from services.conductor.registry import InstanceState

log = logging.getLogger(__name__)
ENGINE_ROLES = (Role.PREFILL, Role.DECODE)


def refusal(
    roles: dict[str, EngineRole],
    switching: set[str],
    instance_id: str,
    role: EngineRole,
    layout: str = "disaggregated",
) -> str:
    """Why this switch may not go ahead ("" if it may). `roles`: the ready engine
    instances and the role each serves as, those switching already left out.

    After it, some instance must still take prompts (prefill or colocated), and prefill
    instances must still have a decode instance to hand their KV to (a colocated one
    takes no handoff). Decode instances beside colocated ones only may stay: idle, but
    nothing they hold is lost, and a prefill instance put back gives them work."""
    if layout == "colocated":
        return "the colocated layout has no prefill/decode split to change"
    if instance_id in switching:
        return f"{instance_id} is switching already"
    now = roles.get(instance_id)
    if now is None:
        return f"no ready prefill, decode or colocated instance {instance_id}"
    if now == role:
        return f"{instance_id} serves as {role} already"
    after = Counter(roles.values())
    after[now] -= 1
    after[role] += 1
    if not after["prefill"] and not after["colocated"]:
        return f"{instance_id} is the last {now} instance: switching it would leave none to prefill"
    if after["prefill"] and not after["decode"]:
        if now == "decode":
            return (
                f"{instance_id} is the last decode instance: switching it would leave none "
                "for the prefill instances to hand off to"
            )
        return f"{instance_id} may not serve as prefill: no decode instance would take its KV"
    return ""


def roles_of(live: dict[Role, list[InstanceState]]) -> dict[str, EngineRole]:
    """Each ready engine instance's role, from the registry's view of its heartbeats."""
    out: dict[str, EngineRole] = {}
    for states in live.values():
        for s in states:
            role = engine_role(s.info)
            if role is not None:
                out[s.info.instance_id] = role
    return out


@dataclass
class Pending:
    """A switch this conductor runs: the instance's incarnation (its started_at) when it
    began, and the task waiting for its answer."""

    switch_id: str
    started_at: float
    task: asyncio.Task[None]
    gone: str = ""  # why the instance can no longer answer (it died or restarted)


class RoleSwitches:
    def __init__(self, conductor: ConductorParts) -> None:
        self.c = conductor
        self.pending: dict[str, Pending] = {}

    def on_beat(self, info: InstanceInfo) -> None:
        """A heartbeat: an instance with a switch under way that restarted (killed while
        it drained, and started again in its old role) will never answer it."""
        p = self.pending.get(info.instance_id)
        if p is not None and info.started_at != p.started_at and not p.gone:
            self._give_up(p, "the instance restarted while it drained")

    def on_dead(self, instance_id: str) -> None:
        p = self.pending.get(instance_id)
        if p is not None and not p.gone:
            self._give_up(p, "the instance stopped heartbeating while it drained")

    def _give_up(self, p: Pending, why: str) -> None:
        p.gone = why
        p.task.cancel()

    def live(self, now: float) -> dict[Role, list[InstanceState]]:
        reg = self.c.registry
        return {r: reg.alive(r, now) for r in ENGINE_ROLES}

    # -- a switch ---------------------------------------------------------------------------
    async def on_role(self, msg: Msg) -> None:
        try:
            change = RoleChange.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad role change: {exc}"))
            return
        try:
            reply = self.begin(change)
        except errors.HalfmoonError as exc:
            await bus.respond(msg, exc)
            return
        except Exception:  # a fault here still answers: never leave the asker waiting
            log.exception("role switch of %s: starting it failed", change.instance_id)
            await bus.respond(msg, errors.HalfmoonError("the conductor failed to start it"))
            return
        await bus.respond(msg, reply)

    def begin(self, change: RoleChange) -> RoleChangeReply:
        """Check a switch and start it (the drain goes on in the background); refused
        with a reason (errors.Rejected) when it may not go ahead."""
        now = time.time()
        live = self.live(now)
        roles = roles_of(live)
        why = refusal(
            roles,
            self.c.registry.switching,
            change.instance_id,
            change.role,
            self.c.settings.layout,
        )
        if why:
            log.warning("role switch of %s refused: %s", change.instance_id, why)
            self._record_refused(change, now, why)
            if why.startswith("no ready"):
                raise errors.HalfmoonError(why, code="not_found").with_status(404)
            raise errors.Conflict(f"role switch refused: {why}")
        from_role = roles[change.instance_id]
        switch_id = uuid.uuid4().hex
        state = next(
            s for ss in live.values() for s in ss if s.info.instance_id == change.instance_id
        )
        self.c.registry.mark_switching(change.instance_id, True)
        self._record(switch_id, change, from_role, now, status="draining")
        task = asyncio.create_task(self._run(switch_id, change, from_role, now))
        self.pending[change.instance_id] = Pending(switch_id, state.info.started_at, task)
        log.info(
            "role switch %s: %s %s -> %s (%s)",
            switch_id,
            change.instance_id,
            from_role,
            change.role,
            change.source,
        )
        return RoleChangeReply(
            switch_id=switch_id,
            instance_id=change.instance_id,
            from_role=from_role,
            to_role=change.role,
        )

    async def _run(
        self, switch_id: str, change: RoleChange, from_role: EngineRole, at: float
    ) -> None:
        timeout_s = self.c.settings.switch_drain_timeout_s
        try:
            done = await bus.request(
                self.c.nc,
                subjects.instance_role(change.instance_id),
                SwitchRole(switch_id=switch_id, role=change.role, drain_timeout_s=timeout_s),
                SwitchDone,
                timeout_s=timeout_s + 15.0,
            )
        except errors.HalfmoonError as exc:
            log.warning("role switch %s of %s failed: %s", switch_id, change.instance_id, exc)
            self._record(switch_id, change, from_role, at, status="failed", detail=exc.message)
        except asyncio.CancelledError:
            p = self.pending.get(change.instance_id)
            if p is None or not p.gone:
                raise  # the conductor is stopping
            log.warning("role switch %s of %s failed: %s", switch_id, change.instance_id, p.gone)
            self._record(switch_id, change, from_role, at, status="failed", detail=p.gone)
        else:
            self._record(
                switch_id,
                change,
                from_role,
                at,
                status="done",
                drain_s=done.drain_s,
                detail=done.detail,
            )
        finally:
            self.c.registry.mark_switching(change.instance_id, False)
            self.pending.pop(change.instance_id, None)

    def _record(
        self,
        switch_id: str,
        change: RoleChange,
        from_role: EngineRole,
        at: float,
        status: str,
        drain_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        if self.c.records is None:
            return
        ended = status != "draining"
        self.c.records.role_switch(
            id=switch_id,
            instance_id=change.instance_id,
            from_role=from_role,
            to_role=change.role,
            source=change.source,
            status=status,
            requested_at=at,
            finished_at=time.time() if ended else None,
            drain_s=drain_s,
            detail=detail,
        )

    def _record_refused(self, change: RoleChange, at: float, why: str) -> None:
        if self.c.records is None:
            return
        self.c.records.role_switch(
            id=uuid.uuid4().hex,
            instance_id=change.instance_id,
            from_role="",
            to_role=change.role,
            source=change.source,
            status="refused",
            requested_at=at,
            finished_at=at,
            drain_s=None,
            detail=why,
        )

    # -- a handoff refused: another decode instance ------------------------------------------
    async def on_redecode(self, msg: Msg) -> None:
        try:
            ask = Redecode.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad redecode: {exc}"))
            return
        try:
            await bus.respond(msg, self.redecode(ask))
        except errors.HalfmoonError as exc:
            await bus.respond(msg, exc)

    def redecode(self, ask: Redecode) -> Placement:
        """The decode instance the policy's rule picks among the live ones not excluded."""
        now = time.time()
        c, req = self.c, ask.request
        decodes = [
            s for s in c.registry.alive(Role.DECODE, now) if s.info.instance_id not in ask.exclude
        ]
        if not decodes:
            raise errors.Unavailable("no other live decode instance", retry_after_s=1.0)
        s = c.settings
        snap = snapshot.build([], decodes, c.cost, s.balancing_threshold, s.slo_margin)
        view = snapshot.request_view(req, {}, s.ttft_slo_ms / 1e3, s.tbt_slo_ms / 1e3)
        decode_id, _ = select_decode(snap, view)
        if not decode_id:
            raise errors.Unavailable("no decode instance has room", retry_after_s=1.0)
        c.registry.dispatched(decode_id, tokens=len(req.prompt_token_ids))
        log.info("request %s: decode moved to %s", req.request_id, decode_id)
        return Placement(request_id=req.request_id, prefill_id="", decode_id=decode_id)
