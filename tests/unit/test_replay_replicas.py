"""bench replay --compare hot-replicas's arithmetic: the copies' bytes from the prefill
instances' KV activity, and the verdict per policy (TTFT p99 and mean with replication
against without, and the simulator's ratio beside the live one)."""

from __future__ import annotations

from services.tools.bench.replay.replicas import PRESET, comparison
from services.tools.bench.replay.reuse import Handoffs


def test_prefill_instances_copies_are_added_up():
    state = {
        "instances": [
            {"role": "prefill", "kv_activity": {"replicas": 2, "replica_bytes": 2048}},
            {"role": "prefill", "kv_activity": {"replicas": 1, "replica_bytes": 1024}},
            {"role": "decode", "kv_activity": {"handoffs": 1, "handoff_bytes": 5}},
        ]
    }
    got = Handoffs.of(state)
    assert (got.replicas, got.replica_bytes, got.handoffs) == (3, 3072, 1)
    assert (got - Handoffs(replicas=1, replica_bytes=1024)).as_json()["replica_bytes"] == 2048


def run(name: str, p99: float, mean: float, copies: int = 0, sim_p99: float | None = None):
    summary = {"ttft": {"p99_ms": p99, "mean_ms": mean}, "rejected": 0}
    out = {
        "name": name,
        "summary": summary,
        "handoffs": Handoffs(replicas=copies, replica_bytes=copies * 2**20).as_json(),
    }
    if sim_p99 is not None:
        out["sim"] = {"summary": {"ttft": {"p99_ms": sim_p99, "mean_ms": mean}}}
    return out


def test_the_verdict_needs_p99_at_most_0_7x_and_the_mean_no_worse():
    (met, missed) = comparison(
        [
            run("largest_prefix_replicas", 600, 300, copies=3, sim_p99=650),
            run("largest_prefix_no_replicas", 1000, 400, sim_p99=1000),
            run("kvcentric_replicas", 950, 410, copies=1),
            run("kvcentric_no_replicas", 1000, 400),
        ]
    )
    assert met["met"] and met["ratio"] == 0.6 and met["replica_bytes"] == 3 * 2**20
    assert met["sim_ratio"] == 0.65 and met["sim_within"]  # 0.65 against 0.6: within 15%
    assert "3 copies moved 3.0 MiB" in met["text"]
    assert not missed["met"] and "NOT met" in missed["text"] and "sim_ratio" not in missed


def test_the_simulator_far_from_live_is_flagged_and_a_lone_run_gives_no_verdict():
    (v,) = comparison(
        [
            run("largest_prefix_replicas", 500, 300, sim_p99=900),
            run("largest_prefix_no_replicas", 1000, 400, sim_p99=1000),
        ]
    )
    assert v["met"] and not v["sim_within"]
    assert comparison([run("kvcentric_replicas", 1, 1)]) == []
    assert {c.name for c in PRESET} == {
        "largest_prefix_replicas",
        "largest_prefix_no_replicas",
        "kvcentric_replicas",
        "kvcentric_no_replicas",
    }
