"""An engine process and its role, prefill, decode or colocated, switched in place.

Colocated is a prefill instance that decodes what it prefills (the conductor names no
decode instance in its jobs), beside prefill and decode instances in one pool: Splitwise's
mixed pool. On the bus it subscribes as prefill; its heartbeat says `colocated`.

Weights load once. The engine (its KV pool and prefix cache) and the engine thread carry
over from one role to the next, so a switch costs a drain, not a reload. This is the
pattern of SGLang's /pd_role_switch and Dynamo's planner: drain, switch, register again.

A switch (SwitchRole from the conductor, which has checked it) goes in four steps:
1. Heartbeats say "switching", so the conductor places nothing new here.
2. Intake closes. Jobs that come anyway are refused, and whoever sent them places them
   elsewhere: the conductor decides a prefill job again, and a prefill asks it for
   another decode instance for a handoff.
3. What the instance holds finishes: prompts in the engine and their handoffs, or
   decode's running sequences and the KV on its way in.
4. The old role's subscriptions go. The new role's instance takes over the engine and
   subscribes, and heartbeats carry the new role.

A drain that outlasts its timeout gives up: intake opens again in the old role, and the
conductor hears why. Nothing that was here is dropped either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import Field

from services.decode.args import DecodeSettings
from services.decode.handlers import DecodeInstance
from services.prefill.args import PrefillSettings
from services.prefill.handlers import PrefillInstance
from services.worker.instance import EngineInstance
from services.worker.metrics import EngineMetrics
from shared import aio, bus, errors, subjects
from shared.engine.runner import LoadedModel
from shared.lifecycle import ServiceRuntime, publish_heartbeat
from shared.messages import InstanceInfo
from shared.role_messages import EngineRole, SwitchDone, SwitchRole
from shared.transfer import KVReceiver, KVSender

log = logging.getLogger(__name__)


class EngineSettings(PrefillSettings, DecodeSettings):
    """Both roles' settings: an instance started as one may serve as the other."""

    role: EngineRole = Field("prefill", description="the role it starts in")


@dataclass
class Bound:
    """A role's instance over the engine, its subscriptions and its engine loop."""

    inst: EngineInstance
    subs: list[Subscription] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    loop: asyncio.Task[None] | None = None


class RoleHost:
    def __init__(
        self,
        settings: EngineSettings,
        rt: ServiceRuntime,
        nc: NATS,
        lm: LoadedModel,
        sender: KVSender,
        receiver: KVReceiver,
    ) -> None:
        self.settings, self.rt, self.nc, self.lm = settings, rt, nc, lm
        self.sender, self.receiver = sender, receiver
        self.bound: Bound | None = None
        self.metrics: EngineMetrics | None = None
        self.role: EngineRole = settings.role
        self.switching_to: EngineRole | None = None

    @property
    def inst(self) -> EngineInstance:
        assert self.bound is not None, "no role yet: start() first"
        return self.bound.inst

    def heartbeat(self) -> InstanceInfo:
        info = self.inst.heartbeat()
        update: dict[str, object] = {"colocated": self.role == "colocated"}
        if self.switching_to is not None:
            update |= {"status": "switching", "switching_to": self.switching_to}
        return info.model_copy(update=update)

    # -- binding a role -----------------------------------------------------------------
    def _instance(self, role: EngineRole, before: EngineInstance | None) -> EngineInstance:
        s = self.settings
        inst: EngineInstance
        if role in ("prefill", "colocated"):  # colocated: its jobs name no decode instance
            inst = PrefillInstance(s, self.nc, self.lm, self.sender, self.receiver, before)
        else:
            inst = DecodeInstance(s, self.nc, self.lm, self.receiver, before)
        inst.kv_port = self.sender.port
        return inst

    async def _subscribe(self, inst: EngineInstance) -> list[Subscription]:
        nc, iid = self.nc, self.settings.instance_id
        if isinstance(inst, PrefillInstance):
            pairs = [
                (subjects.prefill_submit(iid), inst.on_submit),
                (subjects.kv_export(iid), inst.on_export),
                (subjects.prefill_replicate(iid), inst.on_replicate),
                (subjects.prefill_stage(iid), inst.stages.on_stage),
                (subjects.prefill_hop(iid), inst.stages.on_hop),
                (subjects.prefill_stage_close(iid), inst.stages.on_close),
            ]
        else:
            assert isinstance(inst, DecodeInstance)
            pairs = [
                (subjects.decode_submit(iid), inst.on_submit),
                (subjects.decode_hold(iid), inst.kv_holds.on_hold),
                (subjects.decode_stream(iid), inst.kv_holds.on_chunk),
            ]
        pairs.append((subjects.CANCEL, inst.on_cancel))
        return [await nc.subscribe(subject, cb=cb) for subject, cb in pairs]

    async def start(self, role: EngineRole) -> EngineInstance:
        """Serve as `role` (the first time, or after a switch)."""
        before = self.bound.inst if self.bound is not None else None
        inst = self._instance(role, before)
        if self.metrics is None:
            self.metrics = EngineMetrics(inst)
            self.metrics.watch_transfers(self.sender, self.receiver)
        self.metrics.inst = inst
        bound = Bound(inst)
        bound.subs = await self._subscribe(inst)
        bound.loop = asyncio.create_task(inst.serve(bound.stop))
        self.bound = bound
        self.role = role
        if before is None:
            await inst.publish_cleared()  # a previous incarnation's blocks are gone
        return inst

    async def _unbind(self) -> Bound:
        """Stop the engine loop and the subscriptions of the role now served."""
        bound = self.bound
        assert bound is not None
        for sub in bound.subs:
            await sub.unsubscribe()
        bound.stop.set()
        if bound.loop is not None:
            await asyncio.gather(bound.loop, return_exceptions=True)
        return bound

    # -- switching ------------------------------------------------------------------------
    async def on_switch(self, msg: Msg) -> None:
        try:
            req = SwitchRole.model_validate_json(msg.data)
        except ValueError as exc:
            await bus.respond(msg, errors.InvalidRequest(f"bad role switch: {exc}"))
            return
        try:
            done = await self.switch(req)
        except errors.HalfmoonError as exc:
            log.warning("role switch %s refused: %s", req.switch_id, exc.message)
            await bus.respond(msg, exc)
            return
        await bus.respond(msg, done)

    async def switch(self, req: SwitchRole) -> SwitchDone:
        old = self.role
        if self.switching_to is not None:
            raise errors.Rejected(f"already switching to {self.switching_to}")
        if req.role == old:
            raise errors.InvalidRequest(f"already serving as {old}", param="role")
        if self.rt.stop.is_set():
            raise errors.Unavailable("shutting down")
        t0 = time.monotonic()
        self.switching_to = req.role
        self.inst.refuse_intake()
        await self._beat()
        log.info("switch %s: %s -> %s, draining", req.switch_id, old, req.role)
        try:
            detail = await self._drain(req.drain_timeout_s)
        except errors.HalfmoonError:
            self.switching_to = None
            self.inst.intake_open = True
            await self._beat()
            raise
        bound = await self._unbind()
        bound.inst.close_role()
        await self.start(req.role)
        self.switching_to = None
        await self._beat()
        drain_s = time.monotonic() - t0
        log.info("switch %s: now %s after %.2f s (%s)", req.switch_id, req.role, drain_s, detail)
        return SwitchDone(
            switch_id=req.switch_id,
            instance_id=self.settings.instance_id,
            role=req.role,
            drain_s=drain_s,
            detail=detail,
        )

    async def _drain(self, timeout_s: float) -> str:
        """Wait for the instance to hold nothing; what it held at first, as a line."""
        first = self.inst.holds()
        deadline = time.monotonic() + timeout_s
        while (held := self.inst.holds()) and time.monotonic() < deadline:
            self.inst.wake()
            await aio.wait_set(self.rt.stop, 0.05)
            if self.rt.stop.is_set():
                raise errors.Unavailable("shut down while draining")
        if held:
            raise errors.Timeout(f"drain timed out after {timeout_s:g} s: still {held}")
        return f"finished {first}" if first else "nothing to finish"

    async def _beat(self) -> None:
        await publish_heartbeat(self.nc, self.heartbeat())

    # -- shutdown -------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop intake, finish the step in flight, and end what is left with a clear error
        (prefill: what was not handed off; decode: running sequences), never silently."""
        bound = await self._unbind()
        inst = bound.inst
        if isinstance(inst, PrefillInstance):
            await inst.fail_waiting("prefill instance shut down")
        elif isinstance(inst, DecodeInstance):
            await inst.fail_running("decode instance shut down")
        await inst.publish_cleared()
        await _drain_transfers(self.sender, self.settings.transfer_timeout_s)

    def close(self) -> None:
        if self.bound is not None:
            self.bound.inst.close_engine()


async def _drain_transfers(sender: KVSender, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + min(timeout_s, 10.0)
    while sender.pending and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
