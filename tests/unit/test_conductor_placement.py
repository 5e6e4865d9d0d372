from services.conductor.placement import LeastLoaded, RoundRobin, make_policy
from services.conductor.registry import Registry
from shared.messages import InstanceInfo, Role

import pytest


def beat(reg, iid, role=Role.PREFILL, queue=0, running=0, now=100.0):
    reg.seen(InstanceInfo(instance_id=iid, role=role, queue_depth=queue, running=running), now)


def test_dead_instances_leave_placement():
    reg = Registry(expiry_s=3)
    beat(reg, "a", now=100)
    beat(reg, "b", now=102)
    assert {s.info.instance_id for s in reg.alive(Role.PREFILL, 104)} == {"b"}
    assert [s.info.instance_id for s in reg.expire(104)] == ["a"]
    assert reg.alive(Role.DECODE, 104) == []


def test_least_loaded_counts_dispatches_since_last_beat():
    reg = Registry(3)
    beat(reg, "a", queue=1)
    beat(reg, "b", queue=0)
    policy = LeastLoaded()
    assert policy.rank(reg.alive(Role.PREFILL, 100))[0].info.instance_id == "b"
    reg.dispatched("b")
    reg.dispatched("b")
    assert policy.rank(reg.alive(Role.PREFILL, 100))[0].info.instance_id == "a"
    beat(reg, "b", queue=0)  # a fresh heartbeat replaces the local estimate
    assert policy.rank(reg.alive(Role.PREFILL, 100))[0].info.instance_id == "b"


def test_ties_rotate():
    reg = Registry(3)
    for iid in "abc":
        beat(reg, iid)
    policy = LeastLoaded()
    firsts = [policy.rank(reg.alive(Role.PREFILL, 100))[0].info.instance_id for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_round_robin_and_unknown_policy():
    reg = Registry(3)
    beat(reg, "x", queue=9)
    beat(reg, "y")
    rr = RoundRobin()
    assert [rr.rank(reg.alive(Role.PREFILL, 100))[0].info.instance_id for _ in range(3)] == \
        ["x", "y", "x"]
    with pytest.raises(ValueError):
        make_policy("psychic")
