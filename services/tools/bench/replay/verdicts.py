"""The acceptance lines a `halfmoon bench replay` run checks, each where its runs are:
the layout and policy targets here, the fleet's, the planner's, decode-side reuse's and
hot-prefix replication's in their own modules."""

from __future__ import annotations

from typing import Any, Sequence

from services.tools.bench.fleet.verdict import fleet_comparison
from services.tools.bench.replay import elastic, replicas, report, reuse

# (what, summary path, numerator, denominator, target ratio): the acceptance lines.
TARGETS = (
    ("TBT p99, disaggregated / colocated", ("tbt", "p99_ms"), "disaggregated", "colocated", 0.6),
    ("mean TTFT, kvcentric / least_loaded", ("ttft", "mean_ms"), "kvcentric", "least_loaded", 0.8),
)


def targets(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {r["name"]: r["summary"] for r in runs}
    out = []
    for what, path, num, den, target in TARGETS:
        if num in by_name and den in by_name:
            a, b = report.lookup(by_name[num], path), report.lookup(by_name[den], path)
            ratio = a / b if a is not None and b else None
            ok = ratio is not None and ratio <= target
            text = (
                f"{what}: {a:.0f} / {b:.0f} ms = {ratio:.2f}x (target <= {target}x: "
                f"{'met' if ok else 'NOT met'})"
                if ratio is not None
                else f"{what}: n/a"
            )
            out.append({"what": what, "ratio": ratio, "target": target, "met": ok, "text": text})
    return out


def every(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every line whose runs are in this report."""
    return (
        targets(runs)
        + fleet_comparison(runs)
        + elastic.comparison(runs)
        + reuse.comparison(runs)
        + replicas.comparison(runs)
    )
