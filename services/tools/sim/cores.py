"""Shared cores for the simulated instances (processor sharing, with the rest of the
machine's work as a background): see model.py's modelling choices."""

from __future__ import annotations

import heapq

BACKGROUND = "~background"  # next_done's name for the background running dry


class Cores:
    """Processor sharing of `cores` cores among the busy instances, beside a background.

    Work is counted in virtual seconds (what a lone instance with a core to itself would
    take). While k instances are busy, virtual time runs at min(1, cores / k) per real
    second for each of them, so the work items finish in order of their virtual finish
    times, and the next one's real time follows from the current rate. Each change of
    the busy set first brings virtual time up to `now`.

    The background is the rest of the machine's work (the gateway, the conductor, the
    bus, the client): CPU seconds added as requests arrive (add_background), a backlog
    served beside the instances with `background_weight` times an instance's share, as
    the kernel's fair scheduler weighs processes by niceness, on at most
    `background_cap` cores. While it has work it runs at b = min(cap, cores·w / (w + k))
    and the instances share what is left: min(1, (cores - b) / k) each. Its backlog
    running dry is an event like an item's end (next_done names it BACKGROUND)."""

    def __init__(
        self, cores: float, background_weight: float = 1.0, background_cap: float = 1.0
    ) -> None:
        if not cores > 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        if not background_weight > 0 or not background_cap > 0:
            raise ValueError("the background's weight and cap must be > 0")
        self.cores = cores
        self.weight, self.cap = background_weight, min(background_cap, cores)
        self.v = 0.0  # virtual seconds elapsed
        self.t = 0.0  # real seconds when `v` was brought up to date
        self.backlog = 0.0  # the background's CPU seconds still to run
        self.finish: dict[str, float] = {}  # busy instance -> virtual finish of its item
        self._heap: list[tuple[float, str]] = []

    def background_rate(self) -> float:
        if self.backlog <= 0.0:
            return 0.0
        k = len(self.finish)
        return min(self.cap, self.cores * self.weight / (self.weight + k))

    def rate(self) -> float:
        k = len(self.finish)
        return min(1.0, (self.cores - self.background_rate()) / k) if k else 1.0

    def _sync(self, now: float) -> None:
        dt = now - self.t
        b = self.background_rate()
        if dt > 0.0 and b > 0.0 and dt * b >= self.backlog - 1e-12:
            # The background runs dry in this interval (next_done makes that an event, so
            # this is a rounding error, or a caller that skipped it): the rate changes there.
            dry = self.backlog / b
            self.v += dry * self.rate()
            self.backlog, dt = 0.0, dt - dry
        elif dt > 0.0:
            self.backlog -= dt * b
        self.v += dt * self.rate()
        self.t = now

    def add_background(self, now: float, work_s: float) -> None:
        if work_s > 0.0:
            self._sync(now)
            self.backlog += work_s

    def settle(self, now: float) -> None:
        """Bring the accounts up to `now` (the background ran dry: the rates change)."""
        self._sync(now)

    def begin(self, instance_id: str, now: float, work_s: float) -> None:
        self._sync(now)
        vf = self.v + work_s
        self.finish[instance_id] = vf
        heapq.heappush(self._heap, (vf, instance_id))

    def end(self, instance_id: str, now: float) -> None:
        self._sync(now)
        del self.finish[instance_id]

    def next_done(self) -> tuple[float, str] | None:
        """(real time, instance) of the next item to finish at the current rate, or
        (time, BACKGROUND) if the background runs dry first."""
        heap = self._heap
        while heap and self.finish.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # ended or replaced since it was pushed
        b = self.background_rate()
        dry = (self.t + self.backlog / b, BACKGROUND) if b > 0.0 else None
        if not heap:
            return dry
        vf, instance_id = heap[0]
        done = self.t + max(0.0, vf - self.v) / self.rate(), instance_id
        return dry if dry is not None and dry[0] < done[0] else done

    def remaining_s(self, instance_id: str, now: float) -> float:
        """Real seconds left of the instance's item at the current rate."""
        vf = self.finish.get(instance_id)
        if vf is None:
            return 0.0
        v_now = self.v + (now - self.t) * self.rate()
        return max(0.0, vf - v_now) / self.rate()
