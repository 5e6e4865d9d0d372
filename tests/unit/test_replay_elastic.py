"""bench replay --compare elastic: the simulator replays a planner run from the split it
started at with the live conductor's planner settings, and the report's verdicts and
phase splits come from what was measured."""

from dataclasses import replace

from services.conductor.costmodel import CostModel
from services.conductor.planner import PlannerSettings
from services.tools.bench.replay import elastic
from services.tools.bench.replay.machine import split_of
from services.tools.bench.replay.sim_compare import (
    ClusterFacts,
    cluster_facts,
    planner_of,
    replay_config,
)
from shared.run_summary import Slos

PLANNER = {
    "policy": "kvcentric",
    "planner": "active",
    "planner_interval_s": 2.0,
    "planner_window_s": 20.0,
    "planner_min_gain": 0.1,
    "planner_cooldown_s": 10.0,
    "planner_horizon_s": 60.0,
}


def state(roles, placement):
    engines = [
        {"instance_id": f"{r}-{i}", "role": r, "kv_blocks_total": 100} for i, r in enumerate(roles)
    ]
    conductor = {
        "instance_id": "conductor",
        "role": "conductor",
        "leader": True,
        "cost_params": CostModel().params(),
        "cost_model": "built-in",
        "placement": placement,
    }
    return {"instances": [conductor, *engines]}


def test_a_planner_run_is_simulated_from_its_start_with_the_live_settings():
    end = state(["prefill", "decode", "decode"], PLANNER)  # it switched one to decode
    facts = cluster_facts(end, start_split=split_of(state(["prefill", "prefill", "decode"], {})))
    assert (facts.num_prefill, facts.num_decode, facts.start_split) == (1, 2, (2, 1))
    cfg = replay_config(facts, 512, Slos(3.0, 0.05, ()), send_slos=False)
    assert (cfg.num_prefill, cfg.num_decode) == (2, 1)
    assert cfg.planner == PlannerSettings("active", 2.0, 20.0, 0.1, 10.0, 60.0)


def test_without_the_planner_the_split_at_the_end_is_the_one_simulated():
    facts = cluster_facts(state(["prefill", "decode", "decode"], {"policy": "kvcentric"}))
    assert planner_of(facts.placement) is None
    cfg = replay_config(replace(facts, start_split=(2, 1)), 512, Slos(3.0, 0.05, ()), False)
    assert (cfg.num_prefill, cfg.num_decode, cfg.planner) == (1, 2, None)
    assert isinstance(facts, ClusterFacts)


def summary(goodput, requests=10, completed=10, rejected=0):
    return {
        "goodput_rps": goodput,
        "requests": requests,
        "completed": completed,
        "rejected": rejected,
    }


def test_the_planner_is_judged_against_the_better_fixed_split():
    runs = [
        {"name": "planner", "summary": summary(1.2)},
        {"name": "fixed_2p1d", "summary": summary(1.0)},
        {"name": "fixed_1p2d", "summary": summary(1.1, completed=8, rejected=1)},
    ]
    verdicts = elastic.comparison(runs)
    assert verdicts[0]["met"] and abs(verdicts[0]["ratio"] - 1.2 / 1.1) < 1e-9
    assert "fixed_1p2d" in verdicts[0]["text"]
    lost = {v["what"]: v["met"] for v in verdicts[1:]}
    assert lost == {
        "planner: requests failed or unanswered": True,
        "fixed_2p1d: requests failed or unanswered": True,
        "fixed_1p2d: requests failed or unanswered": False,  # 8 + 1 of 10
    }
    runs[0]["summary"] = summary(1.0)
    assert not elastic.comparison(runs)[0]["met"]
    assert elastic.comparison(runs[1:]) == []  # no planner run: nothing to judge


def test_the_split_held_in_each_phase_and_the_changes_seen():
    samples = [
        {"t_s": t, "prefill": p, "decode": d, "switching": []}
        for t, (p, d) in enumerate([(2, 1), (2, 1), (2, 1), (2, 1), (1, 2), (1, 2), (1, 2)])
    ]
    assert elastic.held_by_phase(samples, 3.5) == ["2P+1D", "1P+2D"]
    assert elastic.switches_seen(samples) == 1
    assert elastic.held_by_phase([], 1.0) == ["n/a", "n/a"]


def test_the_preset_gives_every_conductor_the_benchs_slos():
    configs = elastic.preset(3000.0, 50.0)
    assert [c.name for c in configs] == ["planner", "fixed_2p1d", "fixed_1p2d"]
    for c in configs:
        assert c.env["HALFMOON_TTFT_SLO_MS"] == "3000.0" and c.env["HALFMOON_TBT_SLO_MS"] == "50.0"
    assert "--planner" in configs[0].flags and "--planner" not in configs[1].flags
