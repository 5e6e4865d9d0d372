"""Live instances from their heartbeats (pure bookkeeping: time comes in as `now`)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import InstanceInfo, Role


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

    @property
    def load(self) -> int:
        return self.info.queue_depth + self.info.running + self.dispatched_since_beat


class Registry:
    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self._instances: dict[str, InstanceState] = {}

    def seen(self, info: InstanceInfo, now: float) -> bool:
        """Record a heartbeat; True if the instance is new (or back from the dead)."""
        state = self._instances.get(info.instance_id)
        is_new = state is None or now - state.last_seen > self.expiry_s
        self._instances[info.instance_id] = InstanceState(info, now)
        return is_new

    def dispatched(
        self,
        instance_id: str,
        predicted_s: float = 0.0,
        tokens: int = 0,
        count: int = 1,
        blocks: int = 0,
    ) -> None:
        """Account a dispatch (or, with negative values, take a failed one back)."""
        state = self._instances.get(instance_id)
        if state is not None:
            state.dispatched_since_beat += count
            state.pending_s += predicted_s
            state.pending_tokens += tokens
            state.pending_blocks += blocks

    def alive(self, role: Role, now: float) -> list[InstanceState]:
        return [
            s
            for s in self._instances.values()
            if s.info.role == role
            and s.info.status == "ready"
            and now - s.last_seen <= self.expiry_s
        ]

    def expire(self, now: float) -> list[InstanceState]:
        """Forget instances silent for 10x the expiry; returns those newly considered dead."""
        dead = [s for s in self._instances.values() if now - s.last_seen > self.expiry_s]
        for s in dead:
            if now - s.last_seen > 10 * self.expiry_s:
                del self._instances[s.info.instance_id]
        return dead

    def all(self) -> list[InstanceState]:
        return list(self._instances.values())
