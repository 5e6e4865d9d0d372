"""Live instances from their heartbeats (pure bookkeeping: time comes in as `now`).

Built for clusters of hundreds of instances, where a decision must not cost a pass of
Python work per instance: a heartbeat updates its instance's state in place, the list of
live instances per role is kept until something could change it (a new, returning or
re-statused instance, or the oldest heartbeat in it growing too old), and each state keeps
what the snapshot derives from it (snapshot.py) until a heartbeat or a dispatch changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.messages import InstanceInfo, Role

if TYPE_CHECKING:
    from services.conductor.views import InstanceView


@dataclass
class InstanceState:
    info: InstanceInfo
    last_seen: float
    # Jobs this conductor sent since the instance's last heartbeat: the heartbeat's queue
    # depth does not include them yet, and without this a burst would all land on one node.
    dispatched_since_beat: int = 0
    pending_s: float = 0.0  # predicted work of those dispatches
    pending_tokens: int = 0  # and their prompt tokens (decode context)
    pending_blocks: int = 0  # and the KV blocks they will take (decode room)
    # What snapshot.py derives from the fields above, until they change: the reported
    # queue's predicted work (priced once per heartbeat, with the cost model of that
    # moment), and the policy's views of the instance (until a heartbeat or dispatch).
    queue_work_s: float | None = None
    prefill_view: InstanceView | None = field(default=None, repr=False, compare=False)
    decode_view: InstanceView | None = field(default=None, repr=False, compare=False)

    @property
    def load(self) -> int:
        return self.info.queue_depth + self.info.running + self.dispatched_since_beat

    def beat(self, info: InstanceInfo, now: float) -> None:
        """A fresh heartbeat: its report replaces the old one and everything sent since."""
        self.info, self.last_seen = info, now
        self.dispatched_since_beat, self.pending_s = 0, 0.0
        self.pending_tokens = self.pending_blocks = 0
        self.queue_work_s = self.prefill_view = self.decode_view = None


class Registry:
    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self._instances: dict[str, InstanceState] = {}
        # role -> (live instances in first-seen order, when that was worked out, the
        # oldest heartbeat among them then)
        self._alive: dict[Role, tuple[list[InstanceState], float, float]] = {}
        # Instances this conductor told to switch role, until they answer: placed on no
        # more, even while a heartbeat sent before they heard still says "ready".
        self.switching: set[str] = set()

    def mark_switching(self, instance_id: str, on: bool) -> None:
        if on:
            self.switching.add(instance_id)
        else:
            self.switching.discard(instance_id)
        self._alive.clear()

    def seen(self, info: InstanceInfo, now: float) -> bool:
        """Record a heartbeat; True if the instance is new (or back from the dead)."""
        state = self._instances.get(info.instance_id)
        is_new = state is None or now - state.last_seen > self.expiry_s
        if state is None or state.info.role != info.role:
            self._instances[info.instance_id] = InstanceState(info, now)
            self._alive.clear()
            return is_new
        if is_new or state.info.status != info.status:
            self._alive.clear()  # it joins or leaves the live lists
        state.beat(info, now)
        return is_new

    def dispatched(
        self,
        instance_id: str,
        predicted_s: float = 0.0,
        tokens: int = 0,
        count: int = 1,
        blocks: int = 0,
    ) -> None:
        """Account a dispatch (or, with negative values, take a failed one back). A
        heartbeat between the two already left the failed one out of its report: what is
        taken back stops at none (a batch of -1 once divided a decode view by zero)."""
        state = self._instances.get(instance_id)
        if state is not None:
            state.dispatched_since_beat = max(0, state.dispatched_since_beat + count)
            state.pending_s = max(0.0, state.pending_s + predicted_s)
            state.pending_tokens = max(0, state.pending_tokens + tokens)
            state.pending_blocks = max(0, state.pending_blocks + blocks)
            state.prefill_view = state.decode_view = None

    def alive(self, role: Role, now: float) -> list[InstanceState]:
        """Ready instances of `role` heard from within the expiry, in first-seen order.
        The list is the registry's own: callers read it and never change it."""
        cached = self._alive.get(role)
        if cached is not None:
            live, built_at, oldest = cached
            # Heartbeats only move last_seen forward (and any change of membership clears
            # the cache), so while the oldest heartbeat of the list is live, all of it is.
            # The same comparison as below, so the answer is the same to the last bit.
            if built_at <= now and now - oldest <= self.expiry_s:
                return live
        live = [
            s
            for s in self._instances.values()
            if s.info.role == role
            and s.info.status == "ready"
            and now - s.last_seen <= self.expiry_s
            and s.info.instance_id not in self.switching
        ]
        oldest = min((s.last_seen for s in live), default=now)
        self._alive[role] = (live, now, oldest)
        return live

    def expire(self, now: float) -> list[InstanceState]:
        """Forget instances silent for 10x the expiry; returns those newly considered dead."""
        dead = [s for s in self._instances.values() if now - s.last_seen > self.expiry_s]
        for s in dead:
            if now - s.last_seen > 10 * self.expiry_s:
                del self._instances[s.info.instance_id]
                self._alive.clear()
        return dead

    def all(self) -> list[InstanceState]:
        return list(self._instances.values())
