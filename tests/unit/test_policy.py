"""Exact decisions of every placement policy on crafted cluster states."""

import pytest

from services.conductor.costmodel import CostModel
from services.conductor.policy import (POLICIES, InstanceView, RequestView, Snapshot, make_policy)
from services.conductor.registry import Registry
from shared.messages import InstanceInfo, Role

# Round numbers: prefill = 1 ms per new token; decode step = 10 ms + 1 ms per sequence;
# a pulled block costs 2 ms (plus 0 latency); 16-token blocks.
COST = CostModel(prefill_coef=[0.0, 1e-3, 0.0, 0.0], decode_coef=[0.01, 1e-3, 0.0],
                 transfer_latency_s=0.0, transfer_bytes_per_s=1000.0, block_bytes=2, block_size=16,
                 overhead_s=0.0)


def snap(queues, decodes=(("d0", 0),)):
    return Snapshot([InstanceView(i, queue_s=q) for i, q in queues],
                    [InstanceView(i, running=r) for i, r in decodes], COST, balancing_threshold=1.5)


def req(prefix=None, prompt=1600, ttft=100.0, tbt=1.0):
    return RequestView("r", prompt, prefix or {}, ttft, tbt)


def test_kvcentric_prefers_the_holder_when_it_is_idle():
    d = make_policy("kvcentric").decide(snap([("a", 0.0), ("b", 0.0)]), req({"a": 90}))
    assert d.prefill.instance_id == "a" and d.prefill.pull_from == ""
    assert d.prefill.prefill_s == pytest.approx((1600 - 1440) * 1e-3)


def test_kvcentric_pulls_to_an_idle_instance_when_the_holder_is_overloaded():
    d = make_policy("kvcentric").decide(snap([("a", 5.0), ("b", 0.0)]), req({"a": 90}))
    c = d.prefill
    assert (c.instance_id, c.pull_from, c.prefix_blocks) == ("b", "a", 90)
    assert c.transfer_s == pytest.approx(0.18) and c.ttft_s == pytest.approx(0.18 + 0.16)
    assert [x.instance_id for x in d.candidates] == ["a", "b"]


def test_kvcentric_computes_locally_when_pulling_is_not_worth_it():
    # b has 60 of a's 80 blocks: 80/60 < 1.5, so b uses its own cache
    d = make_policy("kvcentric").decide(snap([("a", 5.0), ("b", 0.0)]), req({"a": 80, "b": 60}))
    assert d.prefill.instance_id == "b" and d.prefill.pull_from == "" and d.prefill.prefix_blocks == 60


def test_ties_go_to_the_smallest_id():
    for name in ("kvcentric", "least_loaded", "largest_prefix"):
        d = make_policy(name).decide(snap([("b", 1.0), ("a", 1.0)]), req())
        assert d.prefill.instance_id == "a", name


def test_least_loaded_ignores_the_cache_and_largest_prefix_ignores_the_queue():
    s = snap([("a", 5.0), ("b", 0.0)])
    r = req({"a": 90})
    assert make_policy("least_loaded").decide(s, r).prefill.instance_id == "b"
    assert make_policy("largest_prefix").decide(s, r).prefill.instance_id == "a"


def test_round_robin_and_random_are_deterministic():
    rr = make_policy("round_robin")
    s = snap([("b", 0.0), ("a", 0.0)])
    assert [rr.decide(s, req()).prefill.instance_id for _ in range(3)] == ["a", "b", "a"]
    picks = [POLICIES["random"]().decide(s, req()).prefill.instance_id for _ in range(2)]
    assert picks[0] == picks[1]


def test_slo_misses_are_rejected_with_the_reason():
    d = make_policy("kvcentric").decide(snap([("a", 3.0)]), req(ttft=2.0))
    assert d.rejected.startswith("predicted TTFT 4.60s exceeds the SLO of 2.00s")
    d = make_policy("kvcentric").decide(snap([("a", 0.0)], decodes=[("d0", 200)]), req(tbt=0.1))
    assert "TBT" in d.rejected
    assert make_policy("least_loaded").decide(snap([]), req()).rejected == "no prefill instance"


def test_decode_goes_where_the_predicted_step_is_shortest():
    d = make_policy("kvcentric").decide(snap([("a", 0.0)], decodes=[("d0", 30), ("d1", 4)]), req())
    assert d.decode_id == "d1" and d.tbt_s == pytest.approx(0.01 + 5e-3)


def test_a_dead_instance_is_never_a_candidate():
    reg = Registry(expiry_s=3)
    reg.seen(InstanceInfo(instance_id="a", role=Role.PREFILL), now=100)
    reg.seen(InstanceInfo(instance_id="b", role=Role.PREFILL), now=96)  # silent for 4 s
    assert [s.info.instance_id for s in reg.alive(Role.PREFILL, 100)] == ["a"]


def test_unknown_policy():
    with pytest.raises(ValueError):
        make_policy("psychic")


def test_colocated_decodes_on_the_chosen_instance_and_checks_its_own_batch():
    views = [InstanceView("a", queue_s=0.0, running=200), InstanceView("b", queue_s=1.0, running=2)]
    s = Snapshot(views, views, COST, balancing_threshold=1.5, colocated=True)
    d = make_policy("least_loaded").decide(s, req(tbt=1.0))
    # a has the shorter queue; no decode instance is named, the TBT is a's own batch's
    assert d.prefill.instance_id == "a" and d.decode_id == "" and not d.rejected
    assert d.tbt_s == pytest.approx(0.01 + 201e-3)
    assert "TBT" in make_policy("least_loaded").decide(s, req(tbt=0.1)).rejected
