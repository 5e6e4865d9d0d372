"""The simulator on the very workload a live cluster just served, with what that cluster
knew (bench replay --sim): is `halfmoon sim` a measured instrument?

After a live run, the cluster's /admin/state gives the conductor's cost model as it
stands (calibrated online from the engines' own timings on this machine), the settings it
placed with, the number of prefill and decode instances and each prefill pool's size.

A stack on one machine runs its engines on shared cores: a prefill runs slower while the
other prefill and the decode are busy, which is exactly when queues form. The conductor's
model is fit on wall time, the average of that slowdown. So when the engines report CPU
time as well, the simulator takes the work from the model fit on it (what each piece
costs with a core to itself) and shares the machine's cores among its instances itself
(SimConfig.cores), while its policy predicts with the conductor's own wall-time model, as
the live conductor did.
The simulator then replays the same requests (arrival times, prompt lengths as the server
counted them, output lengths, trace blocks) through the same policy code, and its outcomes
go through the replay's own summary (shared.run_summary.summarize), so every figure is defined once
for both sides.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from services.conductor.costmodel import CostModel
from services.conductor.planner import PlannerSettings
from services.conductor.replication import ReplicationSettings
from services.tools.bench.replay import report
from services.tools.bench.replay.machine import split_of
from services.tools.bench.replay.prompts import PromptPlan
from services.tools.sim.elastic import ElasticCluster
from services.tools.sim.model import SimRequest, with_block_tokens
from services.tools.sim.outcomes import summarize_outcomes
from services.tools.sim.run import SimConfig, simulate
from shared.engine.scheduler import SchedulerConfig
from shared.run_summary import ReplayedRequest, Slos

# (figure, summary path) compared side by side; the bar is 15% on the first three.
FIGURES = (
    ("mean TTFT ms", ("ttft", "mean_ms")),
    ("TBT p99 ms", ("tbt", "p99_ms")),
    ("hit ratio", ("cache_hit_ratio",)),
    ("p99 TTFT ms", ("ttft", "p99_ms")),
    ("rejected", ("rejected",)),
    ("goodput req/s", ("goodput_rps",)),
)
CHECKED = ("mean TTFT ms", "TBT p99 ms", "hit ratio")
TOLERANCE = 0.15
# Simulated runs per comparison, each with its own draws from the measured spreads.
DRAWS = 16


@dataclass(frozen=True)
class ClusterFacts:
    num_prefill: int
    num_decode: int
    prefill_blocks: int  # the smallest prefill pool, in blocks
    cost: CostModel
    placement: dict[str, Any]
    cpu_cost: CostModel | None = None  # the model fit on the engines' CPU time
    cores: float | None = None  # the cores the engines share (None: one each)
    # The rest of the machine's CPU per request, and its weight against an engine
    # (machine.py): the simulator's background on the shared cores.
    background_s_per_request: float = 0.0
    background_weight: float = 1.0
    # The split the run started from, where the planner may have moved it since (None:
    # the split at the end, num_prefill:num_decode, is the one it ran).
    start_split: tuple[int, int] | None = None


def planner_of(placement: dict[str, Any]) -> PlannerSettings | None:
    """The live conductor's planner settings, as its heartbeat reports them (None: off)."""
    mode = placement.get("planner", "off")
    if mode == "off":
        return None
    return PlannerSettings(
        mode=mode,
        interval_s=float(placement["planner_interval_s"]),
        window_s=float(placement["planner_window_s"]),
        min_gain=float(placement["planner_min_gain"]),
        cooldown_s=float(placement["planner_cooldown_s"]),
        horizon_s=float(placement["planner_horizon_s"]),
    )


def replication_of(placement: dict[str, Any]) -> ReplicationSettings | None:
    """The live conductor's hot-prefix replication, as its heartbeat reports it (None: off,
    or a conductor from before it)."""
    if not placement.get("replicate"):
        return None
    return ReplicationSettings(
        max_busy=float(placement["replicate_max_busy"]),
        blocks_per_s=float(placement["replicate_blocks_per_s"]),
        bytes_per_s=float(placement["replicate_mib_per_s"]) * 2**20,
    )


def cluster_facts(
    state: dict[str, Any],
    cores: float | None = None,
    background_s_per_request: float = 0.0,
    background_weight: float = 1.0,
    start_split: tuple[int, int] | None = None,
) -> ClusterFacts:
    """What the live cluster knew at the end of its run, from its GET /admin/state."""
    infos = state["instances"]
    conductors = [i for i in infos if i["role"] == "conductor" and i.get("cost_params")]
    if not conductors:
        raise RuntimeError("no conductor in /admin/state reports its cost model")
    lead = next((c for c in conductors if c.get("leader")), conductors[0])
    prefills = [i for i in infos if i["role"] == "prefill"]
    cpu = lead.get("cpu_cost_params")
    return ClusterFacts(
        *split_of(state),
        min((i["kv_blocks_total"] for i in prefills), default=0),
        CostModel.from_params(lead["cost_params"], f"the live conductor's: {lead['cost_model']}"),
        lead.get("placement", {}),
        CostModel.from_params(cpu, "the live conductor's, fit on CPU time") if cpu else None,
        cores,
        background_s_per_request,
        background_weight,
        start_split,
    )


def sim_requests(
    plans: Sequence[PromptPlan],
    arrivals: Sequence[float],
    records: Sequence[ReplayedRequest],
    block_tokens: int,
) -> list[SimRequest]:
    """The replayed requests as the simulator takes them.

    A prompt's length is what the server counted: the chat template's header (the same
    for every request) and the words; for requests it never counted (rejected), the words
    plus the median header. The header's full blocks lead every prompt in the engine's
    cache, so they lead the simulated one too, as blocks every request shares (negative
    hash ids, which no trace uses): a prompt sharing k trace blocks then shares
    header // block_tokens + k blocks, as it does in the engine, whose blocks cover the
    header and the words in one run."""
    header = int(
        statistics.median(
            [r.prompt_tokens - r.input_tokens for r in records if r.prompt_tokens] or [0]
        )
    )
    lead = [-1 - j for j in range(header // block_tokens)]
    return [
        SimRequest(
            i,
            arrivals[i],
            rec.prompt_tokens or plan.input_tokens + header,
            plan.output_tokens,
            lead + list(plan.hash_ids),
        )
        for i, (plan, rec) in enumerate(zip(plans, records))
    ]


def replay_config(facts: ClusterFacts, block_tokens: int, slos: Slos, send_slos: bool) -> SimConfig:
    """The simulated cluster: the live one's shape, settings and models."""
    p = facts.placement
    threshold = p.get("balancing_threshold")
    # Shared cores only with the work they share: the CPU-time model (engines that report it).
    cpu = facts.cpu_cost if facts.cores is not None else None
    work = with_block_tokens(cpu, block_tokens) if cpu is not None else None
    planner = planner_of(p)
    # With the planner in the loop, the simulated cluster starts where the live one did.
    prefill, decode = (facts.start_split if planner else None) or (
        facts.num_prefill,
        facts.num_decode,
    )
    return SimConfig(
        num_prefill=prefill,
        num_decode=decode,
        cache_blocks=facts.prefill_blocks or None,
        cost=with_block_tokens(facts.cost, block_tokens),
        block_tokens=block_tokens,
        # The conductor rejects by the request's SLOs when the client sends them, else by
        # its own defaults.
        ttft_slo_s=slos.ttft_s if send_slos else float(p.get("ttft_slo_ms", 30_000)) / 1e3,
        tbt_slo_s=slos.tbt_s if send_slos else float(p.get("tbt_slo_ms", 300)) / 1e3,
        slo_margin=float(p.get("slo_margin", 1.0)),
        balancing_threshold=math.inf if threshold is None else float(threshold),
        prewarm=False,  # the live pools start empty
        cores=facts.cores if work is not None else None,
        work_cost=work,
        background_s_per_request=facts.background_s_per_request if work is not None else 0.0,
        background_weight=facts.background_weight,
        # The live engine's steps: its scheduler packs this many prompt tokens per step.
        prefill_chunk_tokens=SchedulerConfig().max_num_batched_tokens,
        planner=planner,
        replication=replication_of(p),
    )


def simulate_replay(
    facts: ClusterFacts,
    requests: Sequence[SimRequest],
    block_tokens: int,
    slos: Slos,
    ideal_hit_ratio: float,
    send_slos: bool,
    draws: int = DRAWS,
) -> dict[str, Any]:
    """The simulator's summary of the same workload, in the replay's terms: the mean of
    `draws` runs, each drawing its handoffs from the measured spread with its own seed
    (a run's TBT p99 is its two or three slowest first gaps, so one draw is noisy), with
    each figure's range over the draws."""
    cfg = replay_config(facts, block_tokens, slos, send_slos)
    policy = str(facts.placement.get("policy", "kvcentric"))
    summaries, wall, switches = [], 0.0, []
    for seed in range(max(1, draws)):
        outcomes, took, cluster = simulate(requests, replace(cfg, seed=seed), policy)
        summaries.append(summarize_outcomes(outcomes, block_tokens, slos, ideal_hit_ratio))
        wall += took
        if isinstance(cluster, ElasticCluster):
            switches.append(len(cluster.switches))
    work_model = cfg.work_cost or cfg.cost
    return {
        "summary": mean_summary(summaries),
        "ranges": {name: figure_range(summaries, path) for name, path in FIGURES},
        "draws": len(summaries),
        "wall_s": wall,
        "cost_model": facts.cost.source,
        "cost_params": facts.cost.params(),
        "work_model": work_model.source,
        "work_params": work_model.params(),
        "cores": cfg.cores,
        "background_s_per_request": cfg.background_s_per_request,
        "background_weight": cfg.background_weight,
        "cores_text": (
            f"the instances share {cfg.cores:g} cores with the rest of the machine's work, "
            f"{cfg.background_s_per_request * 1e3:.0f} ms of CPU per request weighing "
            f"{cfg.background_weight:.1f}x an instance"
            if cfg.cores
            else "each instance on its own cores"
        ),
        "shape": {
            "prefill": cfg.num_prefill,
            "decode": cfg.num_decode,
            "prefill_blocks": facts.prefill_blocks,
        },  # fmt: skip
        # With the planner in the loop: its switches in each draw.
        "switches": switches,
    }


def without_background(facts: ClusterFacts) -> ClusterFacts:
    return replace(facts, background_s_per_request=0.0)


def without_spread(facts: ClusterFacts) -> ClusterFacts:
    cpu = replace(facts.cpu_cost, handoff_spread=[]) if facts.cpu_cost is not None else None
    return replace(facts, cost=replace(facts.cost, handoff_spread=[]), cpu_cost=cpu)


# What each input measured in the live run moves: the simulator again without it.
WITHOUT = (
    ("the rest of the machine's work", without_background),
    ("the handoff's spread (its line only)", without_spread),
)


def ablations(
    facts: ClusterFacts,
    run_sim: Callable[[ClusterFacts], dict[str, Any]],
    live: dict[str, Any],
) -> list[dict[str, Any]]:
    """The checked figures' sim/live ratios with each measured input left out in turn
    (the inputs the run did not measure are skipped). `run_sim`: simulate_replay on the
    live run's requests."""
    rows = []
    for what, leave_out in WITHOUT:
        changed = leave_out(facts)
        if changed == facts:
            continue
        sim = run_sim(changed)
        ratios = {r["figure"]: r["sim_over_live"] for r in side_by_side(live, sim)}
        rows.append({"without": what, "sim_over_live": {f: ratios[f] for f in CHECKED}})
    return rows


def ablation_table(full: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> str:
    """`full`: side_by_side's rows; `rows`: ablations'."""
    ratio = lambda q: "n/a" if q is None else f"{q:.2f}x"  # noqa: E731
    as_measured = {r["figure"]: r["sim_over_live"] for r in full}
    lines = [f"  sim/live of {', '.join(CHECKED)}: what each measured input moves"]
    lines.append(
        f"    {'with every input':54s}" + " / ".join(ratio(as_measured[f]) for f in CHECKED)
    )
    for r in rows:
        q = r["sim_over_live"]
        lines.append(
            f"    {'without ' + r['without']:54s}" + " / ".join(ratio(q[f]) for f in CHECKED)
        )
    return "\n".join(lines)


def mean_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every number averaged over the summaries (same keys), the rest from the first."""
    first = summaries[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [s.get(key) for s in summaries]
        if isinstance(value, dict):
            out[key] = mean_summary([v for v in values if isinstance(v, dict)])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            nums = [v for v in values if isinstance(v, (int, float))]
            out[key] = sum(nums) / len(nums) if len(nums) == len(values) else value
        else:
            out[key] = value
    return out


def figure_range(summaries: Sequence[dict[str, Any]], path: tuple[str, ...]) -> list[float]:
    """[min, max] of one figure over the summaries (empty if some lack it)."""
    values = [report.lookup(s, path) for s in summaries]
    nums = [float(v) for v in values if v is not None]
    return [min(nums), max(nums)] if nums and len(nums) == len(values) else []


def side_by_side(live: dict[str, Any], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure live and simulated (the mean over the simulator's draws, and their
    range), their ratio, and for the checked ones whether the simulator is within the
    tolerance. `sim` is simulate_replay's result."""
    rows = []
    for name, path in FIGURES:
        a, b = report.lookup(live, path), report.lookup(sim["summary"], path)
        ratio = b / a if a and b is not None else None
        row: dict[str, Any] = {
            "figure": name,
            "live": a,
            "sim": b,
            "sim_range": sim.get("ranges", {}).get(name, []),
            "sim_over_live": ratio,
        }
        if name in CHECKED:
            row["within"] = ratio is not None and abs(ratio - 1) <= TOLERANCE
        rows.append(row)
    return rows


def table(name: str, rows: Sequence[dict[str, Any]], draws: int = 1) -> str:
    lines = [
        f"[{name}] simulator against the live run (sim: the mean of {draws} draws):",
        f"{'':16s}{'live':>12s}{'sim':>12s}  sim/live{'':20s}sim's range over the draws",
    ]
    for r in rows:
        a, b, q = r["live"], r["sim"], r["sim_over_live"]
        mark = "" if "within" not in r else ("  within 15%" if r["within"] else "  NOT within 15%")
        fmt = (lambda v: "n/a" if v is None else f"{v:.3f}") if r["figure"] == "hit ratio" else (
            lambda v: "n/a" if v is None else f"{v:.1f}"
        )  # fmt: skip
        lo_hi = r.get("sim_range") or []
        span = f"{fmt(lo_hi[0])} - {fmt(lo_hi[1])}" if lo_hi else ""
        ratio = "n/a" if q is None else f"{q:.2f}x"
        lines.append(f"{r['figure']:16s}{fmt(a):>12s}{fmt(b):>12s}  {ratio + mark:26s}{span}")
    return "\n".join(lines)
