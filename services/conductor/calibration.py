"""The cost model, calibrated online from the times instances report (pure: no I/O, no clock).

Built-in or profiled coefficients fit one machine, dtype and engine version; the same
stack on an AVX2 EPYC in fp32 ran 2-3x slower than they said, and admission admitted and
refused on those numbers. So every engine reports what its work cost (CostSample: a
request's prefill, or a decode step), and the conductor refits each part of the model on
a window of recent samples:

- the prior (the profiled fit for this CPU and dtype, or the built-in defaults) gives the
  shape; its level is rescaled by the median ratio of measured to predicted times, so a
  machine 2.6x slower is right after a handful of samples, and one outlier moves nothing;
- weighted least squares on the model's own terms (costmodel.py) then refines the shape:
  each sample weighted by 1/seconds², so the fit minimizes relative error (what admission
  cares about), and the rescaled prior enters as pseudo-samples at representative points
  worth `prior_weight` samples in all, so terms the samples do not exercise (long prompts,
  when only short ones came) keep the prior's shape;
- recent samples count more: a sample's weight halves every `half_life` samples after it
  (in the median too). Engines that share cores run slower exactly when the cluster is
  busy, so the speed to predict with is the speed of late, not the window's average: with
  equal weights, eight prefills timed alone held the model at their speed through a burst
  at three times capacity, and admission let in requests that then missed their SLO.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

from services.conductor.costmodel import CostModel, decode_features, prefill_features
from shared.messages import CostSample

# The CPU-time fits' window: a whole benchmark run (a decode step is a sample; a 2-core
# stack makes about 20 a second).
RUN_WINDOW = 8192
# A handoff sample's weight in the line halves every this many handoffs after it: the
# prefill and decode fits' recency (OnlineFit's half_life), so a throttled link is followed
# within about as many handoffs.
HANDOFF_HALF_LIFE = 8.0
# How finely the handoff's spread is kept: its ratio to the line at 0, 5%, ... 100%.
SPREAD_POINTS = 21
# Where the prior speaks: prompt lengths × cached tokens, and batch sizes × contexts.
PREFILL_ANCHORS = [(n, c) for n in (16, 128, 512, 2048) for c in (0, 1024)]
DECODE_ANCHORS = [(b, ctx) for b in (1, 8, 32, 64) for ctx in (128, 1024, 4096)]


@dataclass
class OnlineFit:
    """One part of the cost model (prefill or decode step), refit on recent samples."""

    features: Callable[[float, float], list[float]]
    prior: list[float]
    anchors: Sequence[tuple[float, float]]
    window: int = 256
    prior_weight: float = 2.0
    half_life: float = 8.0  # samples

    def __post_init__(self) -> None:
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=self.window)
        self.seen = 0
        self._coef: list[float] | None = list(self.prior)

    def add(self, x1: float, x2: float, seconds: float) -> None:
        if seconds > 0:
            self.samples.append((x1, x2, seconds))
            self.seen += 1
            self._coef = None

    @property
    def coef(self) -> list[float]:
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def predict(self, x1: float, x2: float, coef: list[float] | None = None) -> float:
        c = self.coef if coef is None else coef
        return max(0.0, sum(a * b for a, b in zip(c, self.features(x1, x2))))

    def _fit(self) -> list[float]:
        import numpy as np

        per_anchor = self.prior_weight / len(self.anchors)
        prior = np.array(self.prior)
        n = len(self.samples)
        if not n:
            return list(self.prior)
        x1, x2, y = (np.array(col, dtype=float) for col in zip(*self.samples))
        recency = 0.5 ** ((n - 1 - np.arange(n)) / self.half_life)  # newest: 1
        predicted = np.maximum(self._features(x1, x2) @ prior, 0.0)
        seen = predicted > 0
        level = weighted_median(y[seen] / predicted[seen], recency[seen]) if seen.any() else 1.0
        ax1, ax2 = (np.array(col, dtype=float) for col in zip(*self.anchors))
        a_rows = self._features(ax1, ax2)
        a_y = level * np.maximum(a_rows @ prior, 0.0)
        a_keep = a_y > 0
        # Relative error against the model's own scale (not 1/y², which would favour the
        # fast samples over the slow), and y held within 3x of that scale, so one stall
        # moves the fit by a few percent, not by its size.
        scale = level * predicted
        keep = scale > 0
        a = np.vstack([a_rows[a_keep], self._features(x1, x2)[keep]])
        b = np.concatenate(
            [a_y[a_keep], np.clip(y[keep], scale[keep] / 3, 3 * scale[keep])]
        )  # fmt: skip
        w = np.sqrt(
            np.concatenate([per_anchor / a_y[a_keep] ** 2, recency[keep] / scale[keep] ** 2])
        )  # fmt: skip
        # Scale the columns so their magnitudes (1 .. n²) do not ruin the conditioning.
        col = np.abs(a).max(axis=0)
        col[col == 0] = 1.0
        coef, *_ = np.linalg.lstsq(a / col * w[:, None], b * w, rcond=None)
        return [float(c) for c in coef / col]

    def _features(self, x1: Any, x2: Any) -> Any:
        """The model's terms for arrays of samples, one row each (the constant term
        broadcast)."""
        import numpy as np

        return np.stack(np.broadcast_arrays(*self.features(x1, x2)), axis=1)


def weighted_median(values: Any, weights: Any) -> float:
    """The value at which the cumulative weight (values in order) reaches half."""
    import numpy as np

    order = np.argsort(values, kind="stable")
    acc = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(acc, acc[-1] / 2)])


def robust_line(
    points: Sequence[tuple[int, float]], half_life: float = math.inf
) -> tuple[float, float]:
    """(a, b) of y = a + b·x, both >= 0, that one stall cannot move: Theil's slope (the
    median slope between the i-th point and the one half the sample later, by x) and the
    median intercept. With every x equal it is (median y, 0).

    `points` in arrival order; with a finite `half_life` a point's weight halves every
    that many points after it, so the line follows a link that got slower (or faster)
    within a few handoffs instead of waiting for half the window to turn over."""
    import numpy as np

    n = len(points)
    weights = [0.5 ** ((n - 1 - i) / half_life) for i in range(n)]
    pts = sorted(zip(points, weights))
    h = n // 2
    pairs = [
        ((y2 - y1) / (x2 - x1), (w1 + w2) / 2)
        for ((x1, y1), w1), ((x2, y2), w2) in zip(pts[:h], pts[h:])
        if x2 > x1
    ]
    b = 0.0
    if pairs:
        slopes, w = np.array(pairs).T
        b = max(0.0, weighted_median(slopes, w))
    ys = np.array([y - b * x for (x, y), _ in pts])
    return max(0.0, weighted_median(ys, np.array([w for _, w in pts]))), b


def spread_around(
    points: Iterable[tuple[int, float]], a: float, b: float, num: int = SPREAD_POINTS
) -> list[float]:
    """The measured / predicted ratios of (x, y) points around the line a + b·x, as `num`
    quantiles at evenly spaced probabilities 0..1 (costmodel.spread_at reads them back);
    empty with fewer than two points."""
    ratios = sorted(y / line for x, y in points if (line := a + b * x) > 0)
    if len(ratios) < 2:
        return []
    last = len(ratios) - 1
    out = []
    for k in range(num):
        pos = k * last / (num - 1)
        i = min(int(pos), last - 1)
        out.append(ratios[i] + (ratios[i + 1] - ratios[i]) * (pos - i))
    return out


class Calibrator:
    def __init__(
        self,
        prior: CostModel,
        window: int = 256,
        prior_weight: float = 2.0,
        run_window: int = RUN_WINDOW,
    ) -> None:
        self.prior = prior
        self.prefill, self.decode = self._fits(prior, window, prior_weight)
        # The same fits on the engines' CPU time (CostSample.cpu_seconds): the work
        # without the wait for a core, for a simulator that shares cores itself. These
        # weigh every sample alike over a long window: the simulator replays a whole run,
        # so it wants the run's average work, not the latest speed (at a run's end the
        # engines run alone, and a recency-weighted fit then said the prefills cost 6%
        # more than the run's own samples added up to).
        self.prefill_cpu, self.decode_cpu = self._fits(prior, run_window, prior_weight, math.inf)
        # Handoffs: (blocks, seconds beyond the transfer); the model fits a line robustly,
        # recent ones weighing more (a link's speed changes with what else crosses it).
        self.handoffs: deque[tuple[int, float]] = deque(maxlen=window)
        self.handoffs_seen = 0
        # Dispatches (gateway arrival -> job on a prefill instance): overhead_s is their
        # median. The first token's way back (one bus hop to the gateway) is not in it.
        self.dispatches: deque[float] = deque(maxlen=window)
        # Disk loads: seconds per block read back; disk_s_per_block is their median.
        self.disk_loads: deque[float] = deque(maxlen=window)
        self._model: CostModel | None = prior

    @staticmethod
    def _fits(
        prior: CostModel, window: int, prior_weight: float, half_life: float = 8.0
    ) -> tuple[OnlineFit, OnlineFit]:
        prefill = OnlineFit(
            lambda n, c: prefill_features(n, c),
            list(prior.prefill_coef),
            PREFILL_ANCHORS,
            window,
            prior_weight,
            half_life,
        )
        decode = OnlineFit(
            lambda b, ctx: decode_features(b, ctx),
            list(prior.decode_coef),
            DECODE_ANCHORS,
            window,
            prior_weight,
            half_life,
        )
        return prefill, decode

    def observe(self, samples: Iterable[CostSample]) -> None:
        for s in samples:
            if s.kind == "dispatch":
                self.dispatches.append(s.seconds)
            elif s.kind == "disk":
                blocks = -(-s.tokens // self.prior.block_size)
                if blocks:
                    self.disk_loads.append(s.seconds / blocks)
            elif s.kind == "handoff":
                blocks = -(-s.tokens // self.prior.block_size)
                self.handoffs.append((blocks, max(0.0, s.seconds - self.prior.transfer_s(blocks))))
                self.handoffs_seen += 1
            else:
                fit = self.prefill if s.kind == "prefill" else self.decode
                fit.add(float(s.tokens), s.context, s.seconds)
                if s.cpu_seconds is not None:
                    cpu = self.prefill_cpu if s.kind == "prefill" else self.decode_cpu
                    cpu.add(float(s.tokens), s.context, s.cpu_seconds)
            self._model = None

    def model(self) -> CostModel:
        """The prior with both parts refit on what the instances reported so far."""
        if self._model is None:
            handoff, per_block = (
                robust_line(self.handoffs, HANDOFF_HALF_LIFE)
                if self.handoffs
                else (self.prior.handoff_s, self.prior.handoff_s_per_block)
            )
            self._model = replace(
                self.prior,
                prefill_coef=self.prefill.coef,
                decode_coef=self.decode.coef,
                handoff_s=handoff,
                handoff_s_per_block=per_block,
                handoff_spread=spread_around(self.handoffs, handoff, per_block),
                overhead_s=(
                    statistics.median(self.dispatches) if self.dispatches else self.prior.overhead_s
                ),
                disk_s_per_block=(
                    statistics.median(self.disk_loads)
                    if self.disk_loads
                    else self.prior.disk_s_per_block
                ),
                source=f"{self.prior.source}; calibrated online on {self.prefill.seen} "
                f"prefill, {self.decode.seen} decode and {len(self.handoffs)} handoff samples"
                + (f", overhead on {len(self.dispatches)} dispatches" if self.dispatches else "")
                + (f", disk on {len(self.disk_loads)} loads" if self.disk_loads else ""),
            )
        return self._model

    def cpu_model(self) -> CostModel | None:
        """The model refit on CPU time instead of wall time (None before any such sample):
        what each piece of work costs an engine with a core to itself."""
        if not self.prefill_cpu.seen or not self.decode_cpu.seen:
            return None
        model = self.model()
        return replace(
            model,
            prefill_coef=self.prefill_cpu.coef,
            decode_coef=self.decode_cpu.coef,
            source=f"{self.prior.source}; calibrated online on the CPU time of "
            f"{self.prefill_cpu.seen} prefill and {self.decode_cpu.seen} decode samples",
        )

    def cpu_params(self) -> dict[str, float | int | list[float]]:
        """cpu_model's numbers for a heartbeat; empty before the engines report CPU time."""
        model = self.cpu_model()
        return model.params() if model else {}
