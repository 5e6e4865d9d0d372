"""Small statistics the benchmarks and the simulator share (pure: no I/O)."""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * pct / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def slowest_tenth_mean(gaps: Sequence[float]) -> float:
    """Mooncake's TBT: the mean of the slowest 10% of a request's token gaps (at least one);
    nan for no gaps. The live benchmarks and the simulator both measure TBT with this."""
    if not gaps:
        return float("nan")
    k = max(1, math.ceil(len(gaps) / 10))
    return sum(heapq.nlargest(k, gaps)) / k
