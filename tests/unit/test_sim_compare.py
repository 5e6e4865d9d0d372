"""bench replay --sim: the simulator's outcomes summarized as the replay summarizes a live
run, on round numbers where every figure is known."""

from dataclasses import replace

import pytest

from services.conductor.costmodel import CostModel
from services.tools.bench.replay.prompts import PromptPlan
from services.tools.bench.replay.sim_compare import (
    ClusterFacts,
    ablations,
    mean_summary,
    side_by_side,
    sim_requests,
    simulate_replay,
)
from shared.run_summary import ReplayedRequest, Slos

SLOS = Slos(10.0, 1.0, (0.5, 1.0))


def facts(**placement):
    cost = CostModel(
        prefill_coef=[0.0, 0.01, 0.0, 0.0],  # 10 ms per new token
        decode_coef=[0.1, 0.0, 0.0],  # 100 ms per step
        transfer_latency_s=0.0,
        transfer_bytes_per_s=1.0,
        block_bytes=0,
        block_size=16,
        overhead_s=0.0,
    )
    return ClusterFacts(1, 1, 1000, cost, {"policy": "kvcentric", "slo_margin": 1.0, **placement})


def test_two_requests_sharing_a_prefix_summarize_as_a_live_run_would():
    # 32 words + a 20-token header (one full block, shared by all); the second shares
    # both trace blocks of the first.
    plans = [PromptPlan("", 32, 3, (1, 2)), PromptPlan("", 48, 3, (1, 2, 3))]
    records = [
        ReplayedRequest(0, 0.0, 0.0, 32, 3, "completed", prompt_tokens=52),
        ReplayedRequest(1, 10.0, 0.0, 48, 3, "rejected"),  # never counted: header from r0
    ]
    reqs = sim_requests(plans, [0.0, 10.0], records, 16)
    assert [r.input_length for r in reqs] == [52, 68]
    assert [r.hash_ids for r in reqs] == [[-1, 1, 2], [-1, 1, 2, 3]]
    sim = simulate_replay(facts(), reqs, 16, SLOS, 0.5, send_slos=True)["summary"]
    assert sim["completed"] == 2 and sim["rejected"] == 0
    # r0: 52 new tokens = 0.52 s; r1: header block + 2 blocks cached (48), 20 new = 0.2 s
    assert abs(sim["ttft"]["mean_ms"] - 360.0) < 1e-6
    assert abs(sim["cache_hit_ratio"] - 48 / 120) < 1e-9
    # two decode steps of 100 ms after the first token: the slowest gap is 100 ms
    assert abs(sim["tbt"]["p99_ms"] - 100.0) < 1e-6


def test_with_cpu_time_and_cores_the_work_is_shared_and_the_policy_predicts_as_live():
    # r0 (1.0 s of prefill work) decodes 100 ms steps while r1's 1.0 s prefill runs
    plans = [PromptPlan("", 100, 4, (1,)), PromptPlan("", 100, 2, (9,))]
    records = [
        ReplayedRequest(0, 0.0, 0.0, 100, 4, "completed", prompt_tokens=100),
        ReplayedRequest(1, 1.0, 0.0, 100, 2, "completed", prompt_tokens=100),
    ]
    reqs = sim_requests(plans, [0.0, 1.0], records, 16)
    base = facts()
    own = simulate_replay(base, reqs, 16, SLOS, 0.0, send_slos=True)
    assert own["cores"] is None and "its own cores" in own["cores_text"]
    # The wall-time model said 2x the CPU-time one: the work is the CPU-time model's,
    # shared by the one prefill and one decode on one core.
    wall = replace(base.cost, prefill_coef=[0.0, 0.02, 0.0, 0.0], source="wall")
    cpu = replace(base.cost, source="cpu")
    shared = simulate_replay(
        replace(base, cost=wall, cpu_cost=cpu, cores=1.0), reqs, 16, SLOS, 0.0, send_slos=True
    )
    assert shared["cores"] == 1.0 and shared["work_model"] == "cpu"
    s = shared["summary"]
    # r0 alone: 1.0 s. r1 from 1.0 s beside r0's three 0.1 s steps (each 0.2 s on the
    # shared core: 0.3 s of r1's work in 0.6 s), then 0.7 s alone: TTFT 1.3 s.
    assert abs(s["ttft"]["mean_ms"] - 1150.0) < 1e-6
    # TBT: r0's slowest gap is a shared 200 ms step, r1 decodes alone (100): p99 199
    assert abs(s["tbt"]["p99_ms"] - 199.0) < 1e-6
    assert abs(own["summary"]["tbt"]["p99_ms"] - 100.0) < 1e-6
    # without CPU time (an engine too old to report it) the shape stays one core each
    assert simulate_replay(replace(base, cores=1.0), reqs, 16, SLOS, 0.0, True)["cores"] is None


def test_the_conductor_defaults_reject_when_the_client_sends_no_slos():
    plans = [PromptPlan("", 1000, 3, ())]
    records = [ReplayedRequest(0, 0.0, 0.0, 1000, 3, "rejected")]
    # 10 s of prefill against the conductor's own 5 s TTFT SLO
    sim = simulate_replay(
        facts(ttft_slo_ms=5000.0, tbt_slo_ms=300.0), sim_requests(plans, [0.0], records, 16), 16,
        SLOS, 0.0, send_slos=False,
    )["summary"]  # fmt: skip
    assert sim["rejected"] == 1


def test_side_by_side_marks_the_checked_figures():
    live = {"ttft": {"mean_ms": 100.0, "p99_ms": 300.0}, "tbt": {"p99_ms": 50.0},
            "cache_hit_ratio": 0.3, "rejected": 0, "goodput_rps": 2.0}  # fmt: skip
    sim = {"ttft": {"mean_ms": 110.0, "p99_ms": 200.0}, "tbt": {"p99_ms": 60.0},
           "cache_hit_ratio": 0.3, "rejected": 0, "goodput_rps": 2.0}  # fmt: skip
    rows = {r["figure"]: r for r in side_by_side(live, {"summary": sim})}
    assert rows["mean TTFT ms"]["within"] and not rows["TBT p99 ms"]["within"]
    assert rows["hit ratio"]["within"] and "within" not in rows["p99 TTFT ms"]
    assert rows["rejected"]["sim_over_live"] is None  # 0 live: no ratio


def test_the_simulator_runs_its_draws_and_reports_their_mean_and_range():
    """Handoffs drawn from the measured spread: each draw is a run with its own seed, the
    summary their mean, and each figure's range over them."""
    plans = [PromptPlan("", 32, 3, (i,)) for i in range(6)]
    records = [
        ReplayedRequest(i, float(i), 0.0, 32, 3, "completed", prompt_tokens=32) for i in range(6)
    ]
    reqs = sim_requests(plans, [float(i) for i in range(6)], records, 16)
    base = facts()
    cost = replace(base.cost, handoff_s=0.1, handoff_spread=[1.0, 5.0])
    sim = simulate_replay(replace(base, cost=cost), reqs, 16, SLOS, 0.0, True, draws=5)
    assert sim["draws"] == 5
    lo, hi = sim["ranges"]["TBT p99 ms"]
    assert 200.0 <= lo < hi <= 600.0  # handoffs of 0.1-0.5 s, then a 0.1 s step
    assert lo < sim["summary"]["tbt"]["p99_ms"] < hi
    assert sim["ranges"]["hit ratio"][0] == sim["ranges"]["hit ratio"][1]  # not drawn
    one = [simulate_replay(replace(base, cost=cost), reqs, 16, SLOS, 0.0, True, draws=1)]
    assert one[0]["ranges"]["TBT p99 ms"][0] == one[0]["ranges"]["TBT p99 ms"][1]


def test_mean_summary_averages_every_number_and_keeps_the_rest():
    a = {"ttft": {"mean_ms": 100.0, "n": 2}, "label": "x", "ok": True, "gone": None}
    b = {"ttft": {"mean_ms": 300.0, "n": 4}, "label": "y", "ok": False, "gone": 1.0}
    assert mean_summary([a, b]) == {
        "ttft": {"mean_ms": 200.0, "n": 3.0},
        "label": "x",
        "ok": True,
        "gone": None,
    }


def test_the_rest_of_the_machines_work_shares_the_cores_with_the_engines():
    # One 1.0 s prefill (CPU time) on one shared core: alone it has the core; with 1.0 s
    # of other work per request, weighing as much as an engine, they share it half and
    # half, and both are done at 2.0 s.
    plans = [PromptPlan("", 100, 2, (1,))]
    records = [ReplayedRequest(0, 0.0, 0.0, 100, 2, "completed", prompt_tokens=100)]
    reqs = sim_requests(plans, [0.0], records, 16)
    base = replace(facts(), cpu_cost=facts().cost, cores=1.0)
    free = simulate_replay(base, reqs, 16, SLOS, 0.0, True, draws=1)
    rest = replace(base, background_s_per_request=1.0, background_weight=1.0)
    busy = simulate_replay(rest, reqs, 16, SLOS, 0.0, True, draws=1)
    assert free["summary"]["ttft"]["mean_ms"] == pytest.approx(1000.0)
    assert busy["summary"]["ttft"]["mean_ms"] == pytest.approx(2000.0)
    assert busy["background_s_per_request"] == 1.0 and "1000 ms of CPU" in busy["cores_text"]


def test_ablations_leave_out_each_measured_input_in_turn():
    plans = [PromptPlan("", 100, 2, (1,))]
    records = [ReplayedRequest(0, 0.0, 0.0, 100, 2, "completed", prompt_tokens=100)]
    reqs = sim_requests(plans, [0.0], records, 16)
    cost = replace(facts().cost, handoff_s=0.1, handoff_spread=[1.0, 3.0])
    # on one core, 1.0 s of other work per request weighing as much as the engine
    measured = replace(
        facts(), cost=cost, cpu_cost=cost, cores=1.0, background_s_per_request=1.0
    )  # fmt: skip
    live = {"ttft": {"mean_ms": 2000.0}, "tbt": {"p99_ms": 400.0}, "cache_hit_ratio": 0.5}

    def run_sim(f):
        return simulate_replay(f, reqs, 16, SLOS, 0.0, True)

    rows = ablations(measured, run_sim, live)
    by = {r["without"]: r["sim_over_live"] for r in rows}
    assert list(by) == ["the rest of the machine's work", "the handoff's spread (its line only)"]
    # without the other work the prefill has the core to itself: 1.0 s of the live 2.0
    assert by["the rest of the machine's work"]["mean TTFT ms"] == pytest.approx(0.5)
    # without the spread the handoff is its line, 0.1 s, then a 0.1 s step alone (the
    # other work ran dry at 2.0 s): 200 of the live 400 ms
    assert by["the handoff's spread (its line only)"]["TBT p99 ms"] == pytest.approx(0.5)
    assert by["the handoff's spread (its line only)"]["mean TTFT ms"] == pytest.approx(1.0)
    # what the run did not measure is not left out
    assert ablations(facts(), run_sim, live) == []
