"""The fleet comparison's verdict: Halfmoon's goodput under the SLOs against the better of
the fleets replayed beside it (issue 30's target: 1.3x), each run's hit ratio beside it."""

from __future__ import annotations

from typing import Any, Sequence

FLEET_GOODPUT_TARGET = 1.3


def fleet_comparison(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Halfmoon's goodput against the better fleet's, each hit ratio beside it."""
    fleets = [r for r in runs if r.get("fleet")]
    ours = [r for r in runs if not r.get("fleet")]
    if not fleets or not ours:
        return []
    best = max(fleets, key=lambda r: r["summary"]["goodput_rps"])
    out = []
    for r in ours:
        a, b = r["summary"]["goodput_rps"], best["summary"]["goodput_rps"]
        ratio = a / b if b else None
        ok = ratio is not None and ratio >= FLEET_GOODPUT_TARGET
        hits = ", ".join(f"{x['name']} {x['summary']['cache_hit_ratio']:.0%}" for x in [r, *fleets])
        shown = f"{ratio:.2f}x" if ratio is not None else "n/a (the fleet met no SLO)"
        text = (
            f"goodput, {r['name']} / {best['name']} (the better fleet): {a:.2f} / {b:.2f} "
            f"req/s = {shown} (target >= {FLEET_GOODPUT_TARGET}x: "
            f"{'met' if ok else 'NOT met'}); cache hit ratio {hits}"
        )
        what = f"goodput, {r['name']} / the better fleet"
        out.append(
            {"what": what, "ratio": ratio, "target": FLEET_GOODPUT_TARGET, "met": ok, "text": text}
        )
    return out
