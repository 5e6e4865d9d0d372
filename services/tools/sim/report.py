"""`halfmoon sim --report DIR`: the paper's simulated results in shape, as JSON and an
offline plotly page (Mooncake FAST'25; every run is the services' own policy code).

Four studies on the run's trace, cost model and SLOs:
- the scheduler ablation (Fig. 5): random, load balancing (least_loaded), local
  cache-aware (kvcentric that never pulls) and global cache-aware (kvcentric), mean TTFT;
  the paper's global / local is 3.07 s / 3.58 s = 0.86;
- hit ratio against each prefill instance's cache capacity (Fig. 9's shape), kvcentric;
- effective request capacity against TBT thresholds: the share of requests that meet the
  TTFT SLO and a TBT threshold, for the four schedulers;
- the prefill:decode ratio at a fixed instance count: mean TTFT, TBT p99 and goodput.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from services.tools.sim.model import Outcome, SimRequest
from services.tools.sim.outcomes import summarize_outcomes
from services.tools.sim.results import summarize
from services.tools.sim.run import LOCAL, SimConfig, simulate
from shared.run_summary import Slos

ABLATION = ("random", "least_loaded", LOCAL, "kvcentric")
LABELS = {
    "random": "random",
    "least_loaded": "load balancing",
    LOCAL: "local cache-aware",
    "kvcentric": "global cache-aware",
}
PAPER_GLOBAL_OVER_LOCAL = 3.07 / 3.58
CAPACITIES: tuple[int | None, ...] = (1000, 3000, 10_000, 30_000, None)
TBT_THRESHOLDS_MS = (50, 100, 200, 300, 500, 1000)


def run(requests: Sequence[SimRequest], cfg: SimConfig, policy: str) -> list[Outcome]:
    if policy == LOCAL:
        cfg = replace(cfg, balancing_threshold=math.inf)
    outcomes, _, _ = simulate(requests, cfg, "kvcentric" if policy == LOCAL else policy)
    return outcomes


def replay_summary(outcomes: Sequence[Outcome], cfg: SimConfig) -> dict[str, Any]:
    """The outcomes in bench replay's terms (its goodput and effective capacity), so the
    simulator and the live replay define them once."""
    slos = Slos(cfg.ttft_slo_s, cfg.tbt_slo_s, tuple(t / 1e3 for t in TBT_THRESHOLDS_MS))
    return summarize_outcomes(outcomes, cfg.block_tokens, slos, 0.0)


def studies(requests: Sequence[SimRequest], cfg: SimConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"config": {**asdict(cfg), "cost": asdict(cfg.cost)}}
    ablation, capacity = {}, {}
    for policy in ABLATION:
        outcomes = run(requests, cfg, policy)
        ablation[policy] = asdict(summarize(policy, outcomes, 0.0, cfg.block_tokens))
        capacity[policy] = replay_summary(outcomes, cfg)["effective_capacity_by_tbt_ms"]
    local, glob = ablation[LOCAL]["avg_ttft_s"], ablation["kvcentric"]["avg_ttft_s"]
    out["ablation"] = {
        "mean_ttft_s": {p: r["avg_ttft_s"] for p, r in ablation.items()},
        "global_over_local": glob / local if local else None,
        "paper_global_over_local": PAPER_GLOBAL_OVER_LOCAL,
        "results": ablation,
    }
    out["capacity_by_tbt_ms"] = capacity
    hits = {}
    for blocks in CAPACITIES:
        outcomes = run(requests, replace(cfg, cache_blocks=blocks), "kvcentric")
        r = summarize("kvcentric", outcomes, 0.0, cfg.block_tokens)
        hits["inf" if blocks is None else str(blocks)] = r.hit_ratio
    out["hit_ratio_by_cache_blocks"] = hits
    total = cfg.num_prefill + cfg.num_decode
    sweep = {}
    for prefill in sorted({max(1, round(total * f)) for f in (0.25, 0.375, 0.5, 0.625, 0.75)}):
        if not 0 < prefill < total:
            continue
        shaped = replace(cfg, num_prefill=prefill, num_decode=total - prefill)
        outcomes = run(requests, shaped, "kvcentric")
        r = summarize("kvcentric", outcomes, 0.0, cfg.block_tokens)
        sweep[f"{prefill}:{total - prefill}"] = {
            "mean_ttft_s": r.avg_ttft_s,
            "p99_tbt_s": r.p99_tbt_s,
            "rejected": r.rejected,
            "goodput_rps": replay_summary(outcomes, shaped)["goodput_rps"],
        }
    out["prefill_decode_sweep"] = sweep
    return out


def text(doc: dict[str, Any]) -> str:
    ab = doc["ablation"]
    lines = ["scheduler ablation (Fig. 5), mean TTFT s:"]
    lines += [f"  {LABELS[p]:20s} {t:7.2f}" for p, t in ab["mean_ttft_s"].items()]
    ratio = ab["global_over_local"]
    lines.append(
        f"  global / local: {'n/a' if ratio is None else f'{ratio:.2f}'} "
        f"(paper: {ab['paper_global_over_local']:.2f})"
    )
    lines.append("hit ratio by cache blocks per prefill instance (kvcentric):")
    lines += [f"  {k:>6s} {v:7.2%}" for k, v in doc["hit_ratio_by_cache_blocks"].items()]
    lines.append("effective request capacity by TBT threshold (TTFT SLO met too):")
    lines.append("  " + " ".join(f"{t:>7s}" for t in ["ms", *map(str, TBT_THRESHOLDS_MS)]))
    for p, caps in doc["capacity_by_tbt_ms"].items():
        lines.append(f"  {LABELS[p][:7]:>7s} " + " ".join(f"{v:7.1%}" for v in caps.values()))
    lines.append("prefill:decode at a fixed instance count (kvcentric):")
    for shape, r in doc["prefill_decode_sweep"].items():
        lines.append(
            f"  {shape:>6s} mean TTFT {r['mean_ttft_s']:6.2f} s, TBT p99 "
            f"{r['p99_tbt_s'] * 1e3:6.1f} ms, rejected {r['rejected']}, goodput "
            f"{r['goodput_rps']:.2f} req/s"
        )
    return "\n".join(lines)


def figures(doc: dict[str, Any]) -> list[Any]:
    import plotly.graph_objects as go

    ab = doc["ablation"]["mean_ttft_s"]
    figs = [
        go.Figure(
            go.Bar(x=[LABELS[p] for p in ab], y=list(ab.values())),
            layout={"title": "Scheduler ablation: mean TTFT (s)"},
        )
    ]
    hits = doc["hit_ratio_by_cache_blocks"]
    figs.append(
        go.Figure(
            go.Scatter(x=list(hits), y=list(hits.values()), mode="lines+markers"),
            layout={
                "title": "Hit ratio by cache blocks per prefill instance",
                "yaxis": {"tickformat": ".0%"},
            },
        )
    )
    cap = go.Figure(layout={"title": "Effective request capacity by TBT threshold (ms)"})
    for p, caps in doc["capacity_by_tbt_ms"].items():
        cap.add_trace(go.Scatter(x=list(caps), y=list(caps.values()), name=LABELS[p]))
    cap.update_yaxes(tickformat=".0%")
    figs.append(cap)
    sweep = doc["prefill_decode_sweep"]
    figs.append(
        go.Figure(
            [
                go.Bar(
                    x=list(sweep), y=[r["mean_ttft_s"] for r in sweep.values()], name="mean TTFT s"
                ),
                go.Bar(
                    x=list(sweep),
                    y=[r["goodput_rps"] for r in sweep.values()],
                    name="goodput req/s",
                ),
            ],
            layout={"title": "Prefill:decode at a fixed instance count"},
        )
    )
    return figs


def write(out: Path, doc: dict[str, Any], description: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(
        json.dumps({"description": description, **doc}, indent=2, default=str)
    )
    parts = [f"<h1>Halfmoon simulator</h1><p>{_esc(description)}</p><pre>{_esc(text(doc))}</pre>"]
    for i, fig in enumerate(figures(doc)):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    (out / "report.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Halfmoon simulator</title>"
        "</head><body style='font-family:sans-serif'>" + "".join(parts) + "</body></html>"
    )


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
