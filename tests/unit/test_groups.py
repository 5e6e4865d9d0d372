"""A pipelined prefill group's prefix in the KV index: named by one holder id, alive only
while every stage is, and cleared with any of them."""

from __future__ import annotations

from services.kvmanager.handlers import KVManager
from shared.groups import group_holder, group_members, groups_with, holder_alive
from shared.messages import KVEvent, KVEventKind

GROUP = group_holder([("p0", (0, 15)), ("p1", (15, 30))])


def test_a_group_holder_names_its_stages_and_lives_while_they_all_do():
    assert GROUP == "group:p0@0-15,p1@15-30"
    assert group_members(GROUP) == [("p0", (0, 15)), ("p1", (15, 30))]
    assert group_members("p0") is None
    assert holder_alive(GROUP, {"p0", "p1", "d0"}) and holder_alive("p0", {"p0"})
    assert not holder_alive(GROUP, {"p0", "d0"}) and not holder_alive("p2", {"p0"})
    other = group_holder([("p2", (0, 15)), ("p0", (15, 30))])
    assert groups_with([GROUP, other, "p0", "p1"], "p1") == [GROUP]
    assert groups_with([GROUP, other, "p0"], "p0") == [GROUP, other]


def test_an_instance_that_restarts_clears_the_groups_it_was_a_stage_of():
    kvm = KVManager()
    for holder in (GROUP, "p1", group_holder([("p2", (0, 15)), ("p3", (15, 30))])):
        kvm.apply(KVEvent(kind=KVEventKind.STORED, instance_id=holder, block_hashes=[1, 2]), 0.0)
    kvm.apply(KVEvent(kind=KVEventKind.CLEARED, instance_id="p0"), 1.0)
    held = kvm.index.prefix_match([1, 2])
    assert GROUP not in held  # p0 restarted: its stage pool is gone
    assert set(held) == {"p1", "group:p2@0-15,p3@15-30"}
