"""Hot-prefix replication: copy a hot prefix to more prefill instances ahead of demand
(pure: no I/O, no clock; the live conductor and the simulator run this same code).

kvcentric copies a prefix only when it pulls one for a request, and only once the
holders' queues exceed the pull's transfer: until then a hot prefix piles its requests on
whoever holds it, and every first request elsewhere waits for a pull. Mooncake Store
counts each key's heat and fans hot objects out to more holders; this is that step of
Algorithm 1 done proactively.

The rule, per placed request whose leading blocks the KV manager reports hot
(kvmanager/heat.py: `hot_blocks`, hit `heat_rps` times a second):
- the prefix's load is heat_rps x the prefill time of a request past it (this request is
  the sample), in instance-seconds per second;
- it wants ceil(load / max_busy) holders: no holder should spend more than `max_busy` of
  its time on it;
- fewer holders (in DRAM, plus copies in flight) than that: copy the prefix from its
  least-loaded holder to the least-loaded prefill instance without it,
- if the budget (blocks and bytes per second, a token bucket each) has room.
A copy in flight counts as a holder until the index shows it or `pending_s` passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.conductor.views import InstanceView, RequestView, Snapshot
from shared.groups import GROUP


@dataclass(frozen=True)
class ReplicationSettings:
    enabled: bool = True
    max_busy: float = 0.5  # share of a holder's time one hot prefix may take
    blocks_per_s: float = 2048.0
    bytes_per_s: float = 512 * 2**20
    pending_s: float = 10.0  # a copy not indexed by then is taken as failed

    def __post_init__(self) -> None:
        if not 0 < self.max_busy <= 1:
            raise ValueError(f"max_busy must be in (0, 1], got {self.max_busy}")
        if self.blocks_per_s <= 0 or self.bytes_per_s <= 0 or self.pending_s <= 0:
            raise ValueError("the replication budget and pending_s must be positive")


@dataclass(frozen=True)
class Copy:
    """One ordered copy, and why: what the record and the console show."""

    block_hashes: tuple[int, ...]
    source: str
    target: str
    heat_rps: float
    holders: int
    wanted: int
    nbytes: int
    reason: str

    @property
    def blocks(self) -> int:
        return len(self.block_hashes)


class TokenBucket:
    """`rate` units a second, saved up to one second's worth. A take larger than that
    waits for a full bucket and leaves it in debt, so big copies still go at the rate."""

    def __init__(self, rate: float, now: float = 0.0) -> None:
        self.rate, self.tokens, self.at = rate, rate, now

    def refill(self, now: float) -> None:
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = max(self.at, now)

    def can_take(self, n: float) -> bool:
        return self.tokens >= min(n, self.rate)

    def take(self, n: float) -> None:
        self.tokens -= n


class Replicator:
    def __init__(self, settings: ReplicationSettings, now: float = 0.0) -> None:
        self.settings = settings
        self.blocks = TokenBucket(settings.blocks_per_s, now)
        self.bytes = TokenBucket(settings.bytes_per_s, now)
        self._pending: dict[tuple[int, str], float] = {}  # (prefix's last hash, target) -> until
        self.copies = 0
        self.copied_blocks = 0
        self.copied_bytes = 0
        self.throttled = 0  # copies wanted that the budget held back

    def plan(
        self,
        snap: Snapshot,
        req: RequestView,
        hashes: list[int],
        now: float,
    ) -> Copy | None:
        """The copy this request's hot prefix (`req.hot_blocks` of `hashes`) needs now, if
        any; it is then counted against the budget and as in flight: the caller sends it."""
        hot, heat_rps = min(req.hot_blocks, len(hashes)), req.heat_rps
        if not self.settings.enabled or hot < 1 or heat_rps <= 0:
            return None
        holders = [p for p in snap.prefills if _dram_blocks(req, p.instance_id) >= hot]
        if not holders:
            return None
        key = hashes[hot - 1]
        pending = self._in_flight(key, {p.instance_id for p in holders}, now)
        service_s = _service_s(snap, req, hot)
        wanted = min(len(snap.prefills), math.ceil(heat_rps * service_s / self.settings.max_busy))
        have = len(holders) + len(pending)
        if have >= wanted:
            return None
        taken = {p.instance_id for p in holders} | pending
        others = [p for p in snap.prefills if p.instance_id not in taken]
        if not others:
            return None
        nbytes = round(hot * snap.cost.block_bytes)
        for bucket in (self.blocks, self.bytes):
            bucket.refill(now)
        if not (self.blocks.can_take(hot) and self.bytes.can_take(nbytes)):
            self.throttled += 1
            return None
        self.blocks.take(hot)
        self.bytes.take(nbytes)
        source, target = _least_loaded(holders), _least_loaded(others)
        self._pending[(key, target.instance_id)] = now + self.settings.pending_s
        self.copies, self.copied_blocks = self.copies + 1, self.copied_blocks + hot
        self.copied_bytes += nbytes
        reason = (
            f"{heat_rps:.2f} req/s x {service_s * 1e3:.0f} ms of prefill past the prefix "
            f"wants {wanted} holders at {self.settings.max_busy:.0%} busy; {have} had it"
        )
        return Copy(
            tuple(hashes[:hot]), source.instance_id, target.instance_id, heat_rps,
            have, wanted, nbytes, reason,
        )  # fmt: skip

    def _in_flight(self, key: int, holders: set[str], now: float) -> set[str]:
        """Targets of copies of this prefix still on their way (a landed one is a holder
        now; an expired one failed), dropping those that are not."""
        out = set()
        for k, until in list(self._pending.items()):
            if until <= now or (k[0] == key and k[1] in holders):
                del self._pending[k]
            elif k[0] == key:
                out.add(k[1])
        return out


def _dram_blocks(req: RequestView, instance_id: str) -> int:
    """Leading blocks `instance_id` can export (in DRAM; groups split theirs by layer)."""
    if instance_id.startswith(GROUP):
        return 0
    own = req.prefix_blocks.get(instance_id, 0)
    return own - req.disk_blocks.get(instance_id, 0) if req.disk_blocks else own


def _service_s(snap: Snapshot, req: RequestView, hot: int) -> float:
    """A holder's prefill of this request past the hot prefix."""
    cached = min(hot * snap.cost.block_size, req.prompt_tokens - 1)
    return snap.cost.prefill_s(req.prompt_tokens - cached, cached)


def _least_loaded(instances: list[InstanceView]) -> InstanceView:
    return min(instances, key=lambda p: (p.queue_s, p.instance_id))
