"""`halfmoon bench replay --compare hot-replicas` (issue 32): the skewed workload (`halfmoon
kv synth --hot`) against 2P+1D with hot-prefix replication and without, one cluster after
the other in one run, under largest_prefix and under kvcentric.

largest_prefix places a request where most of its prompt is cached and never pulls, so
without copies a hot prefix's requests all queue on the instance holding it; kvcentric
pulls a prefix to another instance once the holder's queue outweighs the pull, which
already spreads a hot prefix on demand. The copies' bytes are what the prefill instances
fetched for them (their KV activity, reuse.Handoffs). With --sim, the simulator's ratio
of the same runs stands beside the live one.
"""

from __future__ import annotations

from typing import Any, Sequence

from services.tools.bench.replay.cluster import ClusterConfig

SHAPE = "--prefill 2 --decode 1"
OFF = "HALFMOON_REPLICATE=false"
PAIRS = (
    ("largest_prefix_replicas", "largest_prefix_no_replicas", "largest_prefix"),
    ("kvcentric_replicas", "kvcentric_no_replicas", "kvcentric"),
)
PRESET = tuple(
    ClusterConfig.parse(f"{name}={SHAPE} --policy {policy}{f' {OFF}' if off else ''}")
    for on_name, off_name, policy in PAIRS
    for name, off in ((on_name, False), (off_name, True))
)
TARGET = 0.7  # TTFT p99 with replication against without
SIM_TOLERANCE = 0.15  # the simulator's ratio against the live one


def comparison(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy: TTFT p99 and mean with copies against without, the bytes the copies
    moved, and (with --sim) the simulator's p99 ratio beside the live one."""
    by_name = {r["name"]: r for r in runs}
    out = []
    for on_name, off_name, policy in PAIRS:
        if on_name in by_name and off_name in by_name:
            out.append(_pair(policy, by_name[on_name], by_name[off_name]))
    return out


def _pair(policy: str, on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    p99 = _ratio(on["summary"], off["summary"], "p99_ms")
    mean = _ratio(on["summary"], off["summary"], "mean_ms")
    copied = on.get("handoffs", {}).get("replica_bytes", 0) or 0
    copies = on.get("handoffs", {}).get("replicas", 0) or 0
    met = p99 is not None and mean is not None and p99 <= TARGET and mean <= 1.0
    text = (
        f"{policy}: TTFT p99 with / without replication {_x(p99)} (target <= {TARGET}x), "
        f"mean {_x(mean)} (target <= 1.0x): {'met' if met else 'NOT met'}; {copies} copies "
        f"moved {copied / 2**20:,.1f} MiB; rejected {on['summary']['rejected']} / "
        f"{off['summary']['rejected']}"
    )
    verdict: dict[str, Any] = {
        "what": f"hot-prefix replication, {policy}",
        "ratio": p99,
        "mean_ratio": mean,
        "target": TARGET,
        "met": met,
        "replicas": copies,
        "replica_bytes": copied,
    }
    if "sim" in on and "sim" in off:
        sim = _ratio(on["sim"]["summary"], off["sim"]["summary"], "p99_ms")
        close = sim is not None and p99 is not None and abs(sim - p99) <= SIM_TOLERANCE * p99
        verdict |= {"sim_ratio": sim, "sim_within": close}
        text += (
            f"; simulated p99 ratio {_x(sim)} (within {SIM_TOLERANCE:.0%} of live: "
            f"{'met' if close else 'NOT met'})"
        )
    return {**verdict, "text": text}


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    x, y = a.get("ttft", {}).get(key), b.get("ttft", {}).get(key)
    return x / y if x is not None and y else None


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"
