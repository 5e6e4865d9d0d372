"""`halfmoon plan`: how to split N instances between prefill and decode for a trace.

DistServe's offline answer: simulate every fixed split 1..N-1 on the trace (the simulator,
services/tools/sim, with the conductor's own placement) and print each one's goodput
(requests/s meeting both SLOs, shared/run_summary.py's definition), SLO attainment, mean
TTFT and mean TBT, and the best. With --planner, also the online answer: the elastic
planner (services/conductor/planner.py) in the loop, active, from the half-and-half
split; its goodput against the best fixed split and against half-and-half, and the
split it held longest in each half of the trace.

    halfmoon plan --trace T --instances 16 --ttft-slo 5000 --tbt-slo 100 --planner
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from services.conductor.costmodel import CostModel
from services.conductor.planner import PlannerSettings
from services.conductor.planner_types import PlanDecision
from services.kvmanager.traces import load_trace
from services.tools.sim.config import SimConfig
from services.tools.sim.elastic import ElasticCluster
from services.tools.sim.model import SimRequest, with_block_tokens
from services.tools.sim.outcomes import summarize_outcomes
from services.tools.sim.run import simulate, to_sim_requests
from shared.run_summary import Slos


@dataclass
class SplitResult:
    prefill: int
    decode: int
    goodput_rps: float
    attainment: float
    mean_ttft_s: float | None
    mean_tbt_s: float | None
    rejected: int

    @property
    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


@dataclass
class PlannerResult:
    run: SplitResult  # its start split, and what it achieved
    held: list[str]  # the split held longest in each half of the trace
    switches: list[dict[str, Any]] = field(default_factory=list)
    decisions: int = 0


def run_split(requests: Sequence[SimRequest], cfg: SimConfig, policy: str) -> SplitResult:
    outcomes, _, _ = simulate(requests, cfg, policy)
    return _result(cfg, outcomes)


def _result(cfg: SimConfig, outcomes: Sequence[Any]) -> SplitResult:
    s = summarize_outcomes(outcomes, cfg.block_tokens, Slos(cfg.ttft_slo_s, cfg.tbt_slo_s, ()), 0.0)
    ttft, tbt = s["ttft"]["mean_ms"], s["tbt"]["mean_ms"]
    return SplitResult(
        cfg.num_prefill,
        cfg.num_decode,
        s["goodput_rps"],
        s["slo_attainment"],
        None if ttft is None else ttft / 1e3,
        None if tbt is None else tbt / 1e3,
        s["rejected"],
    )


def run_planner(requests: Sequence[SimRequest], cfg: SimConfig, policy: str) -> PlannerResult:
    outcomes, _, cluster = simulate(requests, cfg, policy)
    assert isinstance(cluster, ElasticCluster)
    span = (requests[0].arrival_s, requests[-1].arrival_s) if requests else (0.0, 0.0)
    switches = [{**asdict(r), "drain_s": r.drain_s} for r in cluster.switches]
    return PlannerResult(
        _result(cfg, outcomes), held_splits(cluster.plan, *span), switches, len(cluster.plan)
    )


def held_splits(plan: Sequence[PlanDecision], start_s: float, end_s: float) -> list[str]:
    """The split (ready instances, "pP+dD") held longest in each half of [start_s, end_s]:
    each decision's split counts from it to the next decision."""
    mid = (start_s + end_s) / 2
    halves: list[defaultdict[str, float]] = [defaultdict(float), defaultdict(float)]
    for d, nxt in zip(plan, [*plan[1:], None]):
        until = nxt.now_s if nxt is not None else end_s
        label = f"{d.current[0]}P+{d.current[1]}D"
        halves[0][label] += max(0.0, min(until, mid) - d.now_s)
        halves[1][label] += max(0.0, until - max(d.now_s, mid))
    return [max(h, key=lambda k: (h[k], k)) if h else "" for h in halves]


def sweep(
    requests: Sequence[SimRequest], base: SimConfig, instances: int, policy: str
) -> list[SplitResult]:
    return [
        run_split(requests, replace(base, num_prefill=p, num_decode=instances - p), policy)
        for p in range(1, instances)
    ]


def best(results: Sequence[SplitResult]) -> SplitResult:
    """Highest goodput; ties: the higher attainment, then fewer prefill instances."""
    return max(results, key=lambda r: (r.goodput_rps, r.attainment, -r.prefill))


# ---- the command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon plan",
        description="Simulate every fixed prefill:decode split of N instances on a trace and "
        "print each one's goodput under the SLOs; with --planner, the elastic planner too.",
    )
    p.add_argument("--trace", required=True, help="JSONL trace (halfmoon kv synth --shift)")
    p.add_argument("--instances", type=int, required=True, help="engine instances, N >= 2")
    p.add_argument("--ttft-slo", type=float, required=True, metavar="MS", help="TTFT SLO, ms")
    p.add_argument("--tbt-slo", type=float, required=True, metavar="MS", help="TBT SLO, ms")
    p.add_argument("--planner", action="store_true", help="also run the planner (active)")
    p.add_argument("--policy", default="kvcentric", help="placement policy (%(default)s)")
    p.add_argument(
        "--cost-model",
        default="",
        help="a fitted cost model JSON (`halfmoon profile`); default: the built-in one "
        "(SmolLM2-135M on a CPU core)",
    )
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument(
        "--switch-s", type=float, default=1.0, help="a switch's re-registration (%(default)s)"
    )
    d = PlannerSettings()
    g = p.add_argument_group("planner")
    g.add_argument("--interval-s", type=float, default=d.interval_s, help="(%(default)s)")
    g.add_argument("--window-s", type=float, default=d.window_s, help="(%(default)s)")
    g.add_argument("--min-gain", type=float, default=d.min_gain, help="(%(default)s)")
    g.add_argument("--cooldown-s", type=float, default=d.cooldown_s, help="(%(default)s)")
    g.add_argument("--horizon-s", type=float, default=d.horizon_s, help="(%(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def settings_from_args(args: argparse.Namespace) -> PlannerSettings:
    return PlannerSettings(
        mode="active",
        interval_s=args.interval_s,
        window_s=args.window_s,
        min_gain=args.min_gain,
        cooldown_s=args.cooldown_s,
        horizon_s=args.horizon_s,
    )


def plan(args: argparse.Namespace, requests: Sequence[SimRequest]) -> dict[str, Any]:
    n = args.instances
    cost = CostModel.load(Path(args.cost_model)) if args.cost_model else CostModel()
    base = SimConfig(
        num_prefill=n // 2,
        num_decode=n - n // 2,
        cost=with_block_tokens(cost, args.block_tokens),
        block_tokens=args.block_tokens,
        ttft_slo_s=args.ttft_slo / 1e3,
        tbt_slo_s=args.tbt_slo / 1e3,
        switch_s=args.switch_s,
    )
    fixed = sweep(requests, base, n, args.policy)
    top = best(fixed)
    half = fixed[n // 2 - 1]
    out: dict[str, Any] = {"fixed": fixed, "best_fixed": top, "half_and_half": half}
    if args.planner:
        run = run_planner(requests, replace(base, planner=settings_from_args(args)), args.policy)
        out["planner"] = run
        out["planner_over_best_fixed"] = _ratio(run.run.goodput_rps, top.goodput_rps)
        out["planner_over_half_and_half"] = _ratio(run.run.goodput_rps, half.goodput_rps)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _ms(x: float | None) -> str:
    return "    -" if x is None else f"{x * 1e3:7.0f}"


def text(doc: dict[str, Any]) -> str:
    head = f"{'split':>8} {'goodput req/s':>13} {'attainment':>10} {'TTFT ms':>8} {'TBT ms':>7}"
    rows = [head, "-" * len(head)]
    for r in doc["fixed"]:
        rows.append(
            f"{r.label:>8} {r.goodput_rps:13.2f} {r.attainment:10.1%} {_ms(r.mean_ttft_s):>8} "
            f"{_ms(r.mean_tbt_s):>7}"
        )
    top, half = doc["best_fixed"], doc["half_and_half"]
    rows.append(f"best fixed split: {top.label}, {top.goodput_rps:.2f} req/s")
    run = doc.get("planner")
    if run is not None:
        r = run.run
        vs_best, vs_half = doc["planner_over_best_fixed"], doc["planner_over_half_and_half"]
        rows.append(
            f"planner (active, from {r.label}): {r.goodput_rps:.2f} req/s, attainment "
            f"{r.attainment:.1%}, TTFT {_ms(r.mean_ttft_s).strip()} ms, TBT "
            f"{_ms(r.mean_tbt_s).strip()} ms; {_x(vs_best)} the best fixed split, {_x(vs_half)} "
            f"half-and-half ({half.label}, {half.goodput_rps:.2f} req/s)"
        )
        drains = [s["drain_s"] for s in run.switches if math.isfinite(s["drain_s"])]
        mean_drain = sum(drains) / len(drains) if drains else 0.0
        rows.append(
            f"  {len(run.switches)} switches (mean drain {mean_drain:.1f} s) in "
            f"{run.decisions} decisions; split held longest: first half {run.held[0]}, "
            f"second half {run.held[1]}"
        )
    return "\n".join(rows)


def _x(ratio: float | None) -> str:
    return "n/a x" if ratio is None else f"{ratio:.2f}x"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.instances < 2 or args.ttft_slo <= 0 or args.tbt_slo <= 0:
        print("halfmoon plan: --instances must be >= 2, the SLOs > 0", file=sys.stderr)
        return 2
    try:
        requests = to_sim_requests(load_trace(args.trace, args.limit), 1.0)
    except (OSError, ValueError, KeyError) as exc:
        print(f"halfmoon plan: cannot read trace: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("halfmoon plan: the trace is empty", file=sys.stderr)
        return 2
    if not args.json:
        span = requests[-1].arrival_s - requests[0].arrival_s
        print(
            f"{args.trace}: {len(requests)} requests over {span:.0f} s; {args.instances} "
            f"instances; SLO TTFT {args.ttft_slo:g} ms, TBT {args.tbt_slo:g} ms",
            flush=True,
        )
    doc = plan(args, requests)
    if args.json:
        print(json.dumps(_plain(doc)))
    else:
        print(text(doc))
    return 0


def _plain(x: Any) -> Any:
    """JSON-able: dataclasses as dicts (with a split's label), inf and nan as None."""
    if isinstance(x, SplitResult):
        return {"split": x.label, **_plain(asdict(x))}
    if isinstance(x, PlannerResult):
        return _plain({**asdict(x), "run": x.run})
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
