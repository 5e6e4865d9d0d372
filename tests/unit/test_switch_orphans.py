"""The verdict on a role switch whose conductor stopped before it ended (orphans.outcome)."""

from __future__ import annotations

from services.conductor.orphans import give_up_s, outcome
from shared.messages import InstanceInfo, Role

LIMIT = give_up_s(drain_timeout_s=60.0, expiry_s=3.0)


def beat(role: Role, status: str = "ready", colocated: bool = False) -> InstanceInfo:
    return InstanceInfo(instance_id="i", role=role, status=status, colocated=colocated)


def test_done_as_soon_as_the_instance_is_ready_in_its_new_role():
    assert outcome("decode", 100.0, beat(Role.DECODE), 101.0, LIMIT)[0] == "done"
    colocated = beat(Role.PREFILL, colocated=True)
    assert outcome("colocated", 100.0, colocated, 101.0, LIMIT)[0] == "done"


def test_left_alone_while_its_own_conductor_may_still_be_waiting():
    assert outcome("decode", 100.0, beat(Role.PREFILL, "switching"), 100.0 + LIMIT, LIMIT) is None
    assert outcome("decode", 100.0, None, 100.0 + LIMIT, LIMIT) is None
    assert outcome("decode", 100.0, beat(Role.PREFILL), 101.0, LIMIT) is None


def test_failed_once_past_the_give_up_time():
    late = 100.0 + LIMIT + 1
    assert outcome("decode", 100.0, None, late, LIMIT) == (
        "failed",
        "the instance stopped before its switch was seen to end",
    )
    status, detail = outcome("decode", 100.0, beat(Role.PREFILL), late, LIMIT)
    assert status == "failed" and "not seen as decode" in detail


def test_the_give_up_time_outlasts_the_wait_of_the_conductor_that_began_it():
    assert give_up_s(60.0, 3.0) > 60.0 + 15.0 + 3.0
