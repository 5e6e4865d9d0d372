"""Per-request measurements and a run's summary (pure: no I/O, no clock): the live replay
(bench replay) and the simulator (sim) summarize their requests with this one definition.

TBT follows Mooncake: the mean of the slowest 10% of a request's token gaps. TPOT is the
mean gap after the first token; ITL is every gap, pooled over requests. Goodput counts the
requests that met both SLOs; effective request capacity is the share of sent requests
that met the TTFT SLO and a TBT threshold, for several thresholds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from shared.stats import percentile


@dataclass
class ReplayedRequest:
    index: int  # position in the replayed slice
    arrival_s: float  # scheduled, from the trace (scaled)
    send_lag_s: float  # how late the client sent it (should stay ~0)
    input_tokens: int  # planned words (without the chat template)
    output_tokens: int  # asked for
    status: str  # completed | rejected | failed
    http_status: int = 0
    prompt_tokens: int = 0  # as the server counted them (with the template)
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    tbt_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the answer (live runs): greedy runs of one workload compare it

    def meets(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        return (
            self.status == "completed"
            and self.ttft_s is not None
            and self.ttft_s <= ttft_slo_s
            and (self.tbt_s or 0.0) <= tbt_slo_s
        )


def dist(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean/max of seconds, reported in milliseconds (None when empty)."""
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "mean_ms": None, "max_ms": None}
    return {
        "p50_ms": percentile(values, 50) * 1e3,
        "p90_ms": percentile(values, 90) * 1e3,
        "p99_ms": percentile(values, 99) * 1e3,
        "mean_ms": sum(values) / len(values) * 1e3,
        "max_ms": max(values) * 1e3,
    }


@dataclass(frozen=True)
class Slos:
    ttft_s: float
    tbt_s: float
    tbt_thresholds_s: tuple[float, ...]


def summarize(
    records: Sequence[ReplayedRequest], duration_s: float, slos: Slos, ideal_hit_ratio: float
) -> dict[str, Any]:
    done = [r for r in records if r.status == "completed"]
    n = len(records)
    met = [r for r in done if r.meets(slos.ttft_s, slos.tbt_s)]
    prompt = sum(r.prompt_tokens for r in done)
    out_tokens = sum(r.completion_tokens for r in done)
    capacity = {
        f"{t * 1e3:g}": _share([r for r in done if r.meets(slos.ttft_s, t)], n)
        for t in slos.tbt_thresholds_s
    }
    return {
        "requests": n,
        "completed": len(done),
        "rejected": sum(r.status == "rejected" for r in records),
        "failed": sum(r.status == "failed" for r in records),
        "duration_s": duration_s,
        "throughput_rps": len(done) / duration_s if duration_s else 0.0,
        "output_tokens_per_s": out_tokens / duration_s if duration_s else 0.0,
        "goodput_rps": len(met) / duration_s if duration_s else 0.0,
        "slo_attainment": _share(met, n),
        "effective_capacity_by_tbt_ms": capacity,
        "cache_hit_ratio": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "ideal_hit_ratio": ideal_hit_ratio,
        "max_send_lag_ms": max((r.send_lag_s for r in records), default=0.0) * 1e3,
        "ttft": dist([r.ttft_s for r in done if r.ttft_s is not None]),
        "tbt": dist([r.tbt_s for r in done if r.tbt_s is not None]),
        "tpot": dist([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl": dist([g for r in done for g in r.itl_s]),
        "e2e": dist([r.e2e_s for r in done if r.e2e_s is not None]),
        "slo": {"ttft_ms": slos.ttft_s * 1e3, "tbt_ms": slos.tbt_s * 1e3},
    }


def _share(subset: Sequence[Any], n: int) -> float:
    return len(subset) / n if n else 0.0


def records_json(records: Sequence[ReplayedRequest]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]
