"""Heartbeats → load_samples rows (pure bookkeeping: no I/O, the caller passes the clock).

An instance heartbeats every second; the conductor keeps one row per instance per
sampling interval. Rows are keyed by the interval's start, so two conductors hearing the
same heartbeats write the same keys (the second insert is ignored). Heartbeats carry KV
activity as counters since the instance started; a row holds the difference from the
previous sample, so a lost heartbeat loses nothing and a restart starts from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.messages import InstanceInfo

ACTIVITY = (
    "blocks_stored",
    "blocks_evicted",
    "disk_stored",
    "disk_removed",
    "transfers_in",
    "transfers_out",
    "bytes_in",
    "bytes_out",
)


@dataclass
class _Last:
    slot: float
    t: float
    started_at: float
    counters: dict[str, int]


class LoadSampler:
    def __init__(self) -> None:
        self._last: dict[str, _Last] = {}

    def sample(self, info: InstanceInfo, now: float, interval_s: float) -> dict[str, Any] | None:
        """The row for this heartbeat, or None if its instance has one for this interval."""
        slot = math.floor(now / interval_s) * interval_s
        last = self._last.get(info.instance_id)
        if last is not None and last.slot == slot:
            return None  # (a restart in this interval counts from its start in the next one)
        restarted = last is not None and last.started_at != info.started_at
        counters = {k: int(getattr(info.kv_activity, k)) for k in ACTIVITY}
        self._last[info.instance_id] = _Last(slot, now, info.started_at, counters)
        if last is not None and not restarted:
            deltas: dict[str, int | None] = {
                k: max(v - last.counters[k], 0) for k, v in counters.items()
            }
            interval: float | None = now - last.t
        elif restarted or info.started_at >= now - interval_s:
            # Counters since a start within this interval: all of it is this interval's.
            deltas, interval = dict(counters), now - max(info.started_at, last.t if last else 0)
        else:
            # First sight of an old instance (this conductor just started): since when? Unknown.
            deltas, interval = dict.fromkeys(counters), None
        return {
            "instance_id": info.instance_id,
            "t": slot,
            "role": info.role.value,
            "interval_s": interval,
            "queue_depth": info.queue_depth,
            "running": info.running,
            "kv_blocks_used": max(info.kv_blocks_total - info.kv_blocks_free, 0),
            "kv_blocks_free": info.kv_blocks_free,
            "kv_blocks_cached": info.kv_blocks_cached,
            "disk_blocks_used": info.disk_blocks_used,
            "disk_blocks_free": info.disk_blocks_free,
            **deltas,
        }

    def forget(self, instance_id: str) -> None:
        self._last.pop(instance_id, None)
