"""`halfmoon bench replay`: a Mooncake trace against the live stack.

Against a running gateway:
    halfmoon bench replay --trace FILE --url http://127.0.0.1:8000
Or, starting a fresh local cluster per configuration and putting them side by side:
    halfmoon bench replay --compare layout      # disaggregated 1P+1D vs 2 colocated
    halfmoon bench replay --compare policies    # kvcentric vs least_loaded, 2P+1D
    halfmoon bench replay --config "a=--prefill 2 --decode 1" --config "b=--colocated 3"
    halfmoon bench replay --compare fleet       # Halfmoon 1P+1D vs 2 llama-servers + router
    halfmoon bench replay --fleet "rr=--servers 2 --route round_robin"
    halfmoon bench replay --compare elastic --trace SHIFT.jsonl ...  # planner (elastic.py)
    halfmoon bench replay --compare decode-reuse  # 2P+1D with and without (reuse.py)
    halfmoon bench replay --compare hot-replicas --trace HOT.jsonl ...  # (replicas.py)
Writes report.json and report.html (plotly) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from services.kvmanager.traces import default_trace, load_trace
from services.tools.bench import llama_cpp
from services.tools.bench.fleet import FleetConfig, local_fleet
from services.tools.bench.replay import (
    elastic,
    machine,
    replicas,
    report,
    reuse,
    sim_compare,
    verdicts,
)
from services.tools.bench.replay.cluster import ClusterConfig, local_cluster
from services.tools.bench.replay.prompts import (
    PromptMaker,
    PromptPlan,
    ideal_hit_ratio,
    single_token_words,
)
from services.tools.bench.replay.runner import RunOptions, replay
from services.tools.bench.replay.workload import SliceSpec, arrivals, select
from shared.model_store import ensure_model
from shared.run_summary import ReplayedRequest, Slos, records_json, summarize
from shared.settings import DEFAULT_MODEL_NAME, halfmoon_home

log = logging.getLogger("halfmoon.bench.replay")

# Same cores for both sides: two engine processes each.
LAYOUT = (
    ClusterConfig.parse("disaggregated=--prefill 1 --decode 1 --policy kvcentric"),
    ClusterConfig.parse("colocated=--colocated 2 --policy kvcentric"),
)
# The paper's baseline balances load and ignores the cache (and, like every policy but
# kvcentric, never pulls a prefix).
POLICIES = (
    ClusterConfig.parse("kvcentric=--prefill 2 --decode 1 --policy kvcentric"),
    ClusterConfig.parse("least_loaded=--prefill 2 --decode 1 --policy least_loaded"),
)
# The same 2 engine processes' cores against two llama-servers of a core each (issue 30's
# fleet), fp32 on both sides (the precision every CPU computes natively).
FLEET: tuple[ClusterConfig | FleetConfig, ...] = (
    ClusterConfig.parse("halfmoon=--prefill 1 --decode 1 --policy kvcentric --dtype float32"),
    FleetConfig("fleet_round_robin", route="round_robin"),
    FleetConfig("fleet_prefix", route="prefix"),
)
PRESETS: dict[str, tuple[ClusterConfig | FleetConfig, ...]] = {
    "layout": LAYOUT,
    "policies": POLICIES,
    "all": LAYOUT + POLICIES,
    "fleet": FLEET,
    "decode-reuse": reuse.PRESET,
    "hot-replicas": replicas.PRESET,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        default=default_trace(),
        help="Mooncake trace, JSON Lines (default: env HALFMOON_TRACE, else the "
        "repository's 2%% sample of the conversation trace, which the default "
        "--sample-conversations keeps whole)",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway (single-run mode)")
    p.add_argument(
        "--compare",
        choices=sorted([*PRESETS, "elastic"]),
        help="start a cluster per preset config",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a cluster to start: `halfmoon up` flags, HALFMOON_X=Y env (repeatable)",
    )
    p.add_argument(
        "--fleet",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a fleet to start: llama-servers behind a router, flags --servers N, --route "
        "round_robin|prefix, --precision fp32|int8|bf16, --parallel SLOTS (repeatable; "
        "`halfmoon bench build-llama-cpp` first)",
    )
    p.add_argument("--model", default=DEFAULT_MODEL_NAME, help="model (tokenizer; clusters)")
    _slice_flags(p.add_argument_group("slice"))
    _prompt_flags(p.add_argument_group("prompts"))
    _slo_flags(p.add_argument_group("SLOs"))
    _sim_flags(p)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="", help="report folder (default HALFMOON_HOME/bench/replay-*)")
    return p


def _slice_flags(g: argparse._ArgumentGroup) -> None:
    """Which requests of the trace are replayed, and how fast."""
    g.add_argument("--start", type=int, default=0, help="first trace line")
    g.add_argument("--limit", type=int, default=None, help="trace lines from --start")
    g.add_argument(
        "--sample-conversations",
        type=float,
        default=0.02,
        help="share of conversations kept (whole conversations, so reuse is kept)",
    )
    g.add_argument("--max-requests", type=int, default=None, help="cap after sampling")
    g.add_argument(
        "--time-scale",
        type=float,
        default=0.1,
        help="arrival = trace timestamp x this (0.1: ten times faster)",
    )


def _prompt_flags(g: argparse._ArgumentGroup) -> None:
    """How trace blocks become words, and the prompts' and answers' lengths."""
    g.add_argument(
        "--block-tokens", type=int, default=16, help="tokens per trace block (the trace's are 512)"
    )
    g.add_argument("--max-input-tokens", type=int, default=1024)
    g.add_argument("--max-output-tokens", type=int, default=32)
    g.add_argument("--min-output-tokens", type=int, default=4)
    g.add_argument("--seed", type=int, default=0, help="word draw per hash id")


def _slo_flags(g: argparse._ArgumentGroup) -> None:
    """The SLOs the summary measures against (and, with --send-slos, the conductor too)."""
    g.add_argument("--ttft-slo-ms", type=float, default=10_000.0)
    g.add_argument("--tbt-slo-ms", type=float, default=300.0)
    g.add_argument(
        "--tbt-thresholds-ms",
        default="50,100,200,300,500,1000",
        help="effective capacity at each TBT threshold",
    )
    g.add_argument(
        "--send-slos",
        action="store_true",
        help="put the SLOs on requests, so the conductor may reject early",
    )


def _sim_flags(p: argparse.ArgumentParser) -> None:
    """The simulator beside each live run (sim_compare.py)."""
    p.add_argument(
        "--sim",
        action="store_true",
        help="after each live run, the simulator on the same requests with that cluster's "
        "shape, settings and calibrated cost model, side by side (sim_compare.py)",
    )
    p.add_argument(
        "--sim-cores",
        type=float,
        default=None,
        metavar="N",
        help="--sim: the cores the live cluster's engines share (default: this machine's "
        "for the clusters the bench starts; none, a core each, for --url)",
    )


def plan(args: argparse.Namespace, model_dir: Path) -> tuple[list[PromptPlan], list[float], float]:
    from transformers import AutoTokenizer

    trace = load_trace(args.trace)
    spec = SliceSpec(
        args.start, args.limit, args.sample_conversations, args.max_requests, args.time_scale
    )
    chosen = select(trace, spec)
    if not chosen:
        raise SystemExit("the slice is empty: widen --limit or --sample-conversations")
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    maker = PromptMaker(
        single_token_words(tok),
        args.block_tokens,
        args.max_input_tokens,
        args.max_output_tokens,
        args.min_output_tokens,
        args.seed,
    )
    plans = [maker.make(r) for r in chosen]
    return plans, arrivals(chosen, args.time_scale), ideal_hit_ratio(plans, args.block_tokens)


@dataclass(frozen=True)
class Workload:
    """What every configuration replays, and how it is judged."""

    plans: list[PromptPlan]
    arrivals: list[float]
    ideal_hit_ratio: float
    slos: Slos


async def run_one(name: str, url: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    opts = RunOptions(args.request_timeout_s, args.send_slos, args.ttft_slo_ms, args.tbt_slo_ms)
    n, span = len(work.plans), work.arrivals[-1]
    print(f"[{name}] replaying {n} requests over {span:.0f}s against {url}", flush=True)
    records, wall = await replay(url, work.plans, work.arrivals, opts)
    summary = summarize(records, wall, work.slos, work.ideal_hit_ratio)
    print(
        f"[{name}] done in {wall:.0f}s: {summary['completed']} completed, "
        f"{summary['rejected']} rejected, {summary['failed']} failed",
        flush=True,
    )
    return {"name": name, "summary": summary, "records": records_json(records)}


async def measured_run(
    name: str,
    url: str,
    work: Workload,
    args: argparse.Namespace,
    cores: float | None,
    sample_splits: bool = False,
) -> tuple[dict[str, Any], sim_compare.ClusterFacts | None]:
    """One live run and, with --sim, what the simulator needs of it. With shared cores
    (the stack on this machine), that includes what the rest of the machine took of
    them during the run (machine.py). `sample_splits`: the P:D split over the run."""
    start_state = await machine.admin_state(url) if args.sim else None
    start = machine.split_of(start_state) if start_state else None
    before = machine.mark_of(start_state) if start_state and cores else None
    splits: list[dict[str, Any]] = []
    sampler = (
        asyncio.create_task(elastic.sample_splits(url, 1.0, splits)) if sample_splits else None
    )
    try:
        run = await run_one(name, url, work, args)
    finally:
        if sampler is not None:
            sampler.cancel()
    if sampler is not None:
        run["splits"] = splits
        print(elastic.describe(run, work.arrivals[len(work.arrivals) // 2]), flush=True)
    if not args.sim:
        return run, None
    per_request, weight = 0.0, 1.0
    if before is None:
        state = await machine.admin_state(url)
    else:
        after, state = await machine.mark_after(url)
        use = machine.core_use(before, after)
        per_request = use.background_s_per_request(len(work.plans))
        weight = machine.background_weight(state)
        run["machine"] = {
            "cores": cores,
            "span_s": use.span_s,
            "busy_cores": use.busy_cores,
            "work_cores": use.work_cores,
            "background_cores": use.background_cores,
            "background_s_per_request": per_request,
            "background_weight": weight,
        }
        print(
            f"[{name}] the cores were busy {use.busy_cores:.2f} of {cores:g}: the engines' "
            f"steps {use.work_cores:.2f}, the rest {use.background_cores:.2f} "
            f"({per_request * 1e3:.0f} ms of CPU per request, weighing {weight:.1f}x "
            "an engine)",
            flush=True,
        )
    return run, sim_compare.cluster_facts(state, cores, per_request, weight, start)


def with_sim(
    run: dict[str, Any],
    facts: sim_compare.ClusterFacts | None,
    work: Workload,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The run, and with --sim the simulator's figures for it side by side."""
    if facts is None:
        return run
    if facts.placement.get("layout") == "colocated" or not facts.num_decode:
        print(f"[{run['name']}] --sim: the simulator models disaggregated clusters only")
        return run
    records = [ReplayedRequest(**r) for r in run["records"]]
    requests = sim_compare.sim_requests(work.plans, work.arrivals, records, args.block_tokens)

    def run_sim(f: sim_compare.ClusterFacts) -> dict[str, Any]:
        return sim_compare.simulate_replay(
            f, requests, args.block_tokens, work.slos, work.ideal_hit_ratio, args.send_slos
        )

    sim = run_sim(facts)
    rows = sim_compare.side_by_side(run["summary"], sim)
    print(sim_compare.table(run["name"], rows, sim["draws"]), flush=True)
    if sim["switches"]:
        shape = sim["shape"]
        print(
            f"  (the planner in the loop from {shape['prefill']}P+{shape['decode']}D: "
            f"{min(sim['switches'])}-{max(sim['switches'])} switches per draw)",
            flush=True,
        )
    left_out = sim_compare.ablations(facts, run_sim, run["summary"])
    print(sim_compare.ablation_table(rows, left_out), flush=True)
    c, w = sim["cost_params"], sim["work_params"]
    print(
        f"  (policy's cost model: {sim['cost_model']}: prefill {c['prefill_coef']}, decode "
        f"{c['decode_coef']}, overhead {c['overhead_s']:.3f}s, handoff {c['handoff_s']:.3f}s"
        f" + {c.get('handoff_s_per_block', 0.0) * 1e3:.2f} ms/block;"
        f" the work: {sim['work_model']}: prefill {w['prefill_coef']}, decode "
        f"{w['decode_coef']}; handoff spread (measured / line at 0, 5%, .. 100%) "
        f"{[round(x, 2) for x in w.get('handoff_spread', [])]}; {sim['cores_text']}; "
        f"simulated in {sim['wall_s']:.2f}s)",
        flush=True,
    )
    return {**run, "sim": {**sim, "side_by_side": rows, "without": left_out}}


async def fleet_run(
    cfg: FleetConfig, model_dir: Path, out: Path, work: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    """One replay against a fleet (no simulator: it models Halfmoon clusters)."""
    print(f"[{cfg.name}] starting a fleet: {cfg.describe()}", flush=True)
    slot = llama_cpp.slot_tokens(args.max_input_tokens, args.max_output_tokens)
    async with local_fleet(cfg, model_dir, out, slot) as url:
        run = await run_one(cfg.name, url, work, args)
    return {**run, "config": cfg.describe(), "fleet": True}


async def main_async(args: argparse.Namespace) -> int:
    configs: list[ClusterConfig | FleetConfig] = [ClusterConfig.parse(c) for c in args.config]
    configs += [FleetConfig.parse(f) for f in args.fleet] + list(PRESETS.get(args.compare, ()))
    if args.compare == "elastic":
        configs += elastic.preset(args.ttft_slo_ms, args.tbt_slo_ms)
    model_dir = await asyncio.to_thread(ensure_model, args.model)
    plans, arr, ideal = plan(args, model_dir)
    slos = Slos(
        args.ttft_slo_ms / 1e3,
        args.tbt_slo_ms / 1e3,
        tuple(float(t) / 1e3 for t in args.tbt_thresholds_ms.split(",")),
    )
    work = Workload(plans, arr, ideal, slos)
    out = Path(args.out or halfmoon_home() / "bench" / time.strftime("replay-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    if not configs:
        run, facts = await measured_run("live", args.url, work, args, args.sim_cores)
        runs.append(with_sim(run, facts, work, args))
    for cfg in configs:
        if isinstance(cfg, FleetConfig):
            runs.append(await fleet_run(cfg, model_dir, out, work, args))
            continue
        print(f"[{cfg.name}] starting a local cluster: halfmoon up {cfg.describe()}", flush=True)
        async with local_cluster(cfg, model_dir, out) as url:
            cores = args.sim_cores or float(len(os.sched_getaffinity(0)))
            planner = "--planner" in cfg.flags or args.compare == "elastic"
            before = await reuse.handoffs_now(url)
            run, facts = await measured_run(cfg.name, url, work, args, cores, planner)
            run["handoffs"] = reuse.moved(cfg.name, before, await reuse.handoffs_now(url))
        run = with_sim(run, facts, work, args)
        runs.append({**run, "config": cfg.describe()})
    desc = (
        f"{len(plans)} requests of {Path(args.trace).name} (lines {args.start}+, "
        f"{args.sample_conversations:.0%} of conversations, time x{args.time_scale}); "
        f"{args.block_tokens} tokens per trace block, inputs <= {args.max_input_tokens}, "
        f"outputs {args.min_output_tokens}-{args.max_output_tokens} tokens; SLOs TTFT "
        f"{args.ttft_slo_ms:.0f} ms, TBT {args.tbt_slo_ms:.0f} ms"
    )
    doc: dict[str, Any] = {
        "description": desc,
        "args": vars(args),
        "runs": runs,
        "comparisons": verdicts.every(runs),
    }
    print("\n" + desc + "\n" + report.table(runs))
    for c in doc["comparisons"]:
        print(c["text"])
    report.write_json(out / "report.json", doc)
    report.write_html(out / "report.html", doc)
    print(f"\nreport: {out / 'report.json'}  {out / 'report.html'}")
    return 0 if all(r["summary"]["completed"] for r in runs) else 1


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        return 130
