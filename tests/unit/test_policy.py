"""Exact decisions of every placement policy on crafted cluster states."""

from dataclasses import replace

import pytest

from services.conductor import snapshot
from services.conductor.costmodel import CostModel
from services.conductor.policy import (
    POLICIES,
    InstanceView,
    RequestView,
    Snapshot,
    kv_blocks_needed,
    make_policy,
)
from services.conductor.registry import Registry
from shared.groups import group_holder, group_members
from shared.messages import InstanceInfo, Role

# Round numbers: prefill = 1 ms per new token; decode step = 10 ms + 1 ms per sequence;
# a pulled block costs 2 ms (plus 0 latency); 16-token blocks.
COST = CostModel(
    prefill_coef=[0.0, 1e-3, 0.0, 0.0],
    decode_coef=[0.01, 1e-3, 0.0],
    transfer_latency_s=0.0,
    transfer_bytes_per_s=1000.0,
    block_bytes=2,
    block_size=16,
    overhead_s=0.0,
)


def snap(queues, decodes=(("d0", 0),)):
    return Snapshot(
        [InstanceView(i, queue_s=q) for i, q in queues],
        [InstanceView(i, running=r) for i, r in decodes],
        COST,
        balancing_threshold=1.5,
    )


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
    assert (
        d.prefill.instance_id == "b" and d.prefill.pull_from == "" and d.prefill.prefix_blocks == 60
    )


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


@pytest.mark.parametrize(("max_tokens", "chosen"), [(32, "d1"), (1000, "d0")])
def test_decode_weighs_the_handoff_a_held_prefix_saves_against_the_slower_steps(max_tokens, chosen):
    """d1 caches 90 of the prompt's 100 blocks (a turn before): its handoff moves 10 (20
    ms, against 200), but its steps are 1 ms slower. For 31 tokens to come it finishes
    first (0.516 s against 0.665); for 999 the steps outweigh the handoff."""
    view = replace(req(), max_tokens=max_tokens, decode_blocks={"d1": 90})
    s = snap([("a", 0.0)], decodes=[("d0", 4), ("d1", 5)])
    assert make_policy("kvcentric").decide(s, view).decode_id == chosen
    assert make_policy("kvcentric").decide(s, replace(view, decode_blocks={})).decode_id == "d0"


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


# ---- prefix pulls: part of the decision, kvcentric's alone -------------------------------


def test_kvcentric_pulls_only_past_the_balancing_threshold():
    kv = make_policy("kvcentric")
    busy_holder = [("a", 5.0), ("b", 0.0)]
    # 90 / 60 = 1.5 is not above 1.5: b computes on its own 60 blocks
    c = kv.decide(snap(busy_holder), req({"a": 90, "b": 60})).prefill
    assert (c.instance_id, c.pull_from, c.prefix_blocks, c.transfer_s) == ("b", "", 60, 0.0)
    # 90 / 59 is: b pulls the 31 blocks it lacks, and the transfer is in its TTFT
    c = kv.decide(snap(busy_holder), req({"a": 90, "b": 59})).prefill
    assert (c.instance_id, c.pull_from, c.prefix_blocks) == ("b", "a", 90)
    assert c.transfer_s == pytest.approx(31 * 2e-3)
    assert c.ttft_s == pytest.approx(31 * 2e-3 + (1600 - 1440) * 1e-3)
    # nothing cached counts as one block: a 1-block holder is not worth a pull, 2 are
    assert kv.decide(snap(busy_holder), req({"a": 1})).prefill.pull_from == ""
    assert kv.decide(snap(busy_holder), req({"a": 2})).prefill.pull_from == "a"


def test_every_candidate_carries_its_own_pull_and_the_decision_its_transfer():
    d = make_policy("kvcentric").decide(
        snap([("a", 5.0), ("b", 0.0), ("c", 0.0)]), req({"a": 90, "c": 70})
    )
    by = {c.instance_id: c for c in d.candidates}
    assert (by["a"].pull_from, by["b"].pull_from, by["c"].pull_from) == ("", "a", "")
    assert by["b"].transfer_s == pytest.approx(0.18) and by["c"].transfer_s == 0.0
    # b pulls (0.18 + 0.16 s) and beats c's own 70 blocks (0.48 s); the decision's TTFT
    # is b's, transfer included
    assert d.prefill is by["b"] and d.ttft_s == pytest.approx(0.18 + 0.16)


def test_an_infinite_threshold_never_pulls():
    s = Snapshot(
        [InstanceView("a", queue_s=5.0), InstanceView("b")],
        [InstanceView("d0")],
        COST,
        balancing_threshold=float("inf"),
    )
    d = make_policy("kvcentric").decide(s, req({"a": 90}))
    assert all(c.pull_from == "" and c.transfer_s == 0.0 for c in d.candidates)


@pytest.mark.parametrize("name", ["random", "round_robin", "least_loaded", "largest_prefix"])
def test_the_baselines_never_pull(name):
    # b is idle with nothing cached, a holds 90 blocks behind a long queue: kvcentric would
    # pull to b; a baseline uses the chosen instance's own cache, whichever it chooses.
    d = make_policy(name).decide(snap([("a", 5.0), ("b", 0.0)]), req({"a": 90}))
    assert all(c.pull_from == "" and c.transfer_s == 0.0 for c in d.candidates)
    own = {"a": 90, "b": 0}[d.prefill.instance_id]
    assert d.prefill.prefix_blocks == own


# ---- decode: room for the request's KV ---------------------------------------------------


def decodes_with_room(*rooms):
    return Snapshot(
        [InstanceView("a")],
        [InstanceView(f"d{i}", running=i, kv_blocks_free=r) for i, r in enumerate(rooms)],
        COST,
        1.5,
    )


def test_decode_blocks_cover_the_prompt_and_every_output_token():
    r = RequestView("r", 1600, {}, 100.0, 1.0, max_tokens=17)  # 1617 tokens: 102 blocks
    assert kv_blocks_needed(decodes_with_room(None), r) == 102
    d = make_policy("kvcentric").decide(decodes_with_room(None), r)
    assert d.decode_blocks == 102 and d.decode_id == "d0"


def test_decode_skips_an_instance_without_room_when_another_has_it():
    r = RequestView("r", 1600, {}, 100.0, 1.0, max_tokens=16)  # 101 blocks
    # d0 has the shortest step but 100 free blocks; d1 fits exactly; d2 is unknown (room)
    d = make_policy("kvcentric").decide(decodes_with_room(100, 101), r)
    assert d.decode_id == "d1" and not d.rejected
    assert d.tbt_s == pytest.approx(0.01 + 2e-3)  # d1's batch (1 running) plus this one
    assert make_policy("kvcentric").decide(decodes_with_room(100, 0, None), r).decode_id == "d2"


def test_decode_rejects_only_when_no_instance_has_room():
    r = RequestView("r", 1600, {}, 100.0, 1.0, max_tokens=16)
    d = make_policy("least_loaded").decide(decodes_with_room(100, 50), r)
    assert d.rejected == "no decode instance with room for 101 KV blocks" and d.decode_id == ""
    empty = Snapshot([InstanceView("a")], [], COST, 1.5)
    assert make_policy("least_loaded").decide(empty, r).rejected == "no decode instance"


def test_two_quick_decisions_do_not_count_the_same_free_blocks():
    # A decode instance reported 150 free blocks (20 of them held for an import waiting for
    # room); each request needs 101. The first dispatch promises them: until the next
    # heartbeat the second decision sees 29 and goes to the other instance.
    reg = Registry(expiry_s=3)
    reg.seen(InstanceInfo(instance_id="a", role=Role.PREFILL), now=0)
    reg.seen(
        InstanceInfo(
            instance_id="d0",
            role=Role.DECODE,
            kv_blocks_total=200,
            kv_blocks_free=150,
            kv_blocks_leased=20,
        ),
        now=0,
    )
    reg.seen(
        InstanceInfo(
            instance_id="d1", role=Role.DECODE, running=50, kv_blocks_total=200, kv_blocks_free=120
        ),
        now=0,
    )
    r = RequestView("r", 1600, {}, 100.0, 10.0, max_tokens=16)

    def decide():
        s = snapshot.build(reg.alive(Role.PREFILL, 0), reg.alive(Role.DECODE, 0), COST, 1.5)
        return make_policy("kvcentric").decide(s, r)

    first = decide()
    assert first.decode_id == "d0" and first.decode_blocks == 101
    reg.dispatched("d0", tokens=1600, blocks=first.decode_blocks)
    assert snapshot.decode_view(reg.alive(Role.DECODE, 0)[0]).kv_blocks_free == 29
    assert decide().decode_id == "d1"
    # a heartbeat reports what the instance holds now: the promise is no longer pending
    reg.seen(
        InstanceInfo(instance_id="d0", role=Role.DECODE, kv_blocks_total=200, kv_blocks_free=200),
        now=1,
    )
    assert decide().decode_id == "d0"


def test_an_instance_reporting_no_pool_is_assumed_to_have_room():
    reg = Registry(expiry_s=3)
    reg.seen(InstanceInfo(instance_id="d0", role=Role.DECODE), now=0)
    assert snapshot.decode_view(reg.alive(Role.DECODE, 0)[0]).kv_blocks_free is None


# ---- pipelined prefill (groups) -------------------------------------------------------------

FAST_HOPS = replace(COST, transfer_bytes_per_s=1e12)  # hidden states hop at no cost


def group_snap(queues, max_stages=3, min_tokens=8000):
    s = snap(queues)
    return replace(s, cost=FAST_HOPS, max_stages=max_stages, pipeline_min_tokens=min_tokens)


def test_a_long_prompt_goes_to_the_group_that_prefills_it_soonest():
    d = make_policy("kvcentric").decide(
        group_snap([("a", 0), ("b", 0), ("c", 0)]), req(prompt=16384)
    )
    c = d.prefill
    assert [i for i, _ in c.stages] == ["a", "b", "c"] and c.instance_id == "a"
    assert [t.layers for _, t in c.stages] == [(0, 10), (10, 20), (20, 30)]
    # 32 chunks of 0.512 s over 3 equal stages: (32 + 2) * 0.512 / 3, against 16.384 s alone
    assert c.ttft_s == pytest.approx(34 * 0.512 / 3)
    sizes = sorted(len(x.stages) for x in d.candidates)
    assert sizes == [0, 2, 3]  # one single prediction (same prefix everywhere), two groups


def test_groups_form_from_idle_instances_only_and_need_two():
    d = make_policy("kvcentric").decide(
        group_snap([("a", 0), ("b", 3.0), ("c", 0)]), req(prompt=16384)
    )
    assert [i for i, _ in d.prefill.stages] == ["a", "c"]
    d = make_policy("kvcentric").decide(group_snap([("a", 0), ("b", 3.0)]), req(prompt=16384))
    assert not d.prefill.stages


def test_below_the_threshold_a_group_is_weighed_only_when_no_single_meets_the_slo():
    policy, s = make_policy("kvcentric"), group_snap([("a", 0), ("b", 0)], min_tokens=20000)
    d = policy.decide(s, req(prompt=16384, ttft=100.0))
    assert not d.prefill.stages and all(not x.stages for x in d.candidates)
    d = policy.decide(s, req(prompt=16384, ttft=10.0))  # alone 16.4 s; two stages 8.4 s
    assert len(d.prefill.stages) == 2 and not d.rejected
    off = replace(s, max_stages=1)
    assert policy.decide(off, req(prompt=16384, ttft=10.0)).rejected


def test_a_cached_prefix_on_one_instance_beats_a_cold_group():
    d = make_policy("kvcentric").decide(
        group_snap([("a", 0), ("b", 0), ("c", 0)]), req({"b": 900}, prompt=16384)
    )
    assert d.prefill.instance_id == "b" and not d.prefill.stages


def test_a_group_holding_the_prefix_reuses_it_and_no_single_instance_pulls_from_it():
    holder = "group:b@0-15,c@15-30"
    assert group_members(holder) == [("b", (0, 15)), ("c", (15, 30))]
    assert group_holder([("b", (0, 15)), ("c", (15, 30))]) == holder
    s = group_snap([("a", 0), ("b", 0), ("c", 0)])
    d = make_policy("kvcentric").decide(s, req({holder: 1000}, prompt=16384))
    c = d.prefill
    assert [i for i, _ in c.stages] == ["b", "c"] and c.prefix_blocks == 1000
    assert c.ttft_s == pytest.approx(0.384, rel=1e-5)  # 384 new tokens, stage after stage
    assert all(x.pull_from == "" for x in d.candidates)
    busy = group_snap([("a", 0), ("b", 2.0), ("c", 0)])
    d = make_policy("kvcentric").decide(busy, req({holder: 1000}, prompt=16384))
    assert [i for i, _ in d.prefill.stages] != ["b", "c"]  # b is busy: not that group


def test_a_colocated_instance_in_a_disaggregated_pool_decodes_its_own():
    """A colocated instance among prefill and decode instances keeps the requests placed on
    it (no decode instance named, its own batch sets the TBT, no decode KV reserved); a
    request placed on a prefill instance still goes to a decode instance."""
    own = InstanceView("c", running=3)
    s = Snapshot(
        [InstanceView("c", queue_s=0.0), InstanceView("p", queue_s=1.0)],
        [InstanceView("d", running=50)],
        COST,
        balancing_threshold=1.5,
        own_decodes={"c": own},
    )
    d = make_policy("least_loaded").decide(s, req())
    assert (d.prefill.instance_id, d.decode_id, d.decode_blocks) == ("c", "", 0)
    assert d.tbt_s == pytest.approx(0.01 + 4e-3) and not d.rejected
    busy = replace(s, prefills=[InstanceView("c", queue_s=2.0), InstanceView("p", queue_s=1.0)])
    d = make_policy("least_loaded").decide(busy, req())
    assert (d.prefill.instance_id, d.decode_id) == ("p", "d")
    assert d.tbt_s == pytest.approx(0.01 + 51e-3)
    # its own batch, not the decode pool's, is what the TBT SLO is checked against
    crowded = replace(s, own_decodes={"c": InstanceView("c", running=500)})
    assert "TBT" in make_policy("least_loaded").decide(crowded, req(tbt=0.1)).rejected


def test_colocated_instances_are_never_pipeline_stages():
    from services.conductor.groups import group_candidates

    s = Snapshot(
        [InstanceView(i) for i in ("a", "b", "c")],
        [InstanceView("d")],
        COST,
        own_decodes={"c": InstanceView("c")},
        max_stages=3,
    )
    stages = {i for g in group_candidates(s, req()) for i, _ in g.stages}
    assert stages == {"a", "b"}


def test_the_snapshot_gives_colocated_heartbeats_their_own_batch():
    reg = Registry(expiry_s=3.0)
    for iid, colocated in (("c", True), ("p", False)):
        reg.seen(
            InstanceInfo(instance_id=iid, role=Role.PREFILL, colocated=colocated, running=2),
            now=100,
        )
    prefills = reg.alive(Role.PREFILL, 100)
    s = snapshot.build(prefills, [], COST, 1.5)
    assert [p.instance_id for p in s.prefills] == ["c", "p"]
    assert list(s.own_decodes) == ["c"] and s.own_decodes["c"].running == 2


# ---- tiers: a block on disk is priced at its read, a remote one at its transfer ------------


def disk_req(on_disk: int, own: int = 90) -> RequestView:
    return RequestView("r", 1600, {"a": own}, 100.0, 1.0, disk_blocks={"a": on_disk})


def test_a_disk_hit_is_read_back_when_that_is_quicker_than_computing_it():
    fast = replace(COST, disk_s_per_block=1e-4)  # 16 tokens: 16 ms to compute, 0.1 ms to read
    d = make_policy("kvcentric").decide(snap([("a", 0.0)]), disk_req(30))
    c = make_policy("kvcentric").decide(replace(snap([("a", 0.0)]), cost=fast), disk_req(30))
    for got in (d.prefill, c.prefill):
        assert (got.prefix_blocks, got.disk_blocks, got.disk_skipped) == (90, 30, False)
    assert c.prefill.disk_s == pytest.approx(30 * 1e-4)
    assert c.prefill.ttft_s == pytest.approx(30 * 1e-4 + (1600 - 1440) * 1e-3)


def test_a_disk_slower_than_recomputing_is_left_alone_and_the_record_says_why():
    slow = replace(COST, disk_s_per_block=0.05)  # 50 ms a block against 16 ms to compute it
    s = replace(snap([("a", 0.0)]), cost=slow)
    d = make_policy("kvcentric").decide(s, disk_req(30))
    c = d.prefill
    assert (c.prefix_blocks, c.disk_blocks, c.disk_skipped, c.disk_s) == (60, 30, True, 0.0)
    assert c.ttft_s == pytest.approx((1600 - 960) * 1e-3)  # 30 more blocks computed
    from services.conductor.handlers import disk_record, prefill_job
    from shared.messages import GenerateRequest, SamplingParams

    assert disk_record(c) == {
        "disk_blocks": 30,
        "disk_ms": None,
        "disk": "recomputed: reading them back is predicted slower than computing them",
    }
    req = GenerateRequest(
        request_id="r",
        model="m",
        prompt_token_ids=[1] * 1600,
        sampling=SamplingParams(),
        arrival_time=0.0,
    )
    assert prefill_job(req, d).skip_disk  # the engine is told to leave them there
    # the baselines price them the same way
    assert make_policy("largest_prefix").decide(s, disk_req(30)).prefill.disk_skipped


def test_a_holder_whose_prefix_is_on_disk_is_not_pulled_from():
    """An export reads DRAM only: blocks on the holder's disk tier are no pull's."""
    busy_holder = snap([("a", 5.0), ("b", 0.0)])
    on_disk = RequestView("r", 1600, {"a": 90}, 100.0, 1.0, disk_blocks={"a": 80})
    c = make_policy("kvcentric").decide(busy_holder, on_disk).prefill
    assert (c.instance_id, c.pull_from, c.prefix_blocks) == ("b", "a", 10)
    everything = RequestView("r", 1600, {"a": 90}, 100.0, 1.0, disk_blocks={"a": 90})
    c = make_policy("kvcentric").decide(busy_holder, everything).prefill
    assert (c.instance_id, c.pull_from, c.prefix_blocks) == ("b", "", 0)
