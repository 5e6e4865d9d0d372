"""The leader lease's state machine (pure: outcomes and time are arguments)."""

from __future__ import annotations

import pytest

from services.conductor.leader import Lease, State


def test_acquire_makes_a_leader_until_ttl_minus_half_a_renewal():
    lease = Lease(ttl_s=3.0, renew_s=1.0)
    assert lease.state is State.STANDBY and not lease.is_leader
    assert lease.acquired(revision=7, sent_at=100.0) is True
    assert lease.is_leader and lease.term == 7 and lease.revision == 7
    # The server expires the entry ttl after it stored it (after we sent it): we stop before.
    assert lease.valid_until == pytest.approx(102.5)


def test_renewals_move_the_deadline_and_keep_the_term():
    lease = Lease(ttl_s=3.0, renew_s=1.0)
    lease.acquired(7, 100.0)
    assert lease.renewed(9, 101.0) is False  # no change of state
    assert (lease.revision, lease.term, lease.valid_until) == (9, 7, pytest.approx(103.5))


def test_failed_renewals_keep_the_lead_only_until_the_deadline():
    lease = Lease(ttl_s=3.0, renew_s=1.0)
    lease.acquired(7, 100.0)
    assert lease.failed(101.0) is False and lease.is_leader
    assert lease.failed(102.4) is False and lease.is_leader
    assert lease.failed(102.5) is True and not lease.is_leader
    assert (lease.revision, lease.valid_until) == (0, 0.0)
    assert lease.failed(200.0) is False  # a standby has nothing to lose


def test_someone_elses_write_deposes_at_once():
    lease = Lease(ttl_s=3.0, renew_s=1.0)
    assert lease.taken() is False  # a standby losing a campaign changes nothing
    lease.acquired(7, 100.0)
    assert lease.taken() is True and lease.state is State.STANDBY


def test_expiry_without_any_call():
    lease = Lease(ttl_s=2.0, renew_s=0.5)
    lease.acquired(1, 10.0)
    assert lease.expired(11.0) is False
    assert lease.expired(11.75) is True
    assert lease.expired(11.8) is False  # reported once


def test_release_and_reacquire_starts_a_new_term():
    lease = Lease(ttl_s=3.0, renew_s=1.0)
    lease.acquired(4, 0.0)
    assert lease.released() is True and lease.released() is False
    lease.acquired(12, 5.0)
    assert lease.term == 12


def test_misuse_is_an_error():
    with pytest.raises(ValueError, match="at most half"):
        Lease(ttl_s=3.0, renew_s=2.0)
    lease = Lease(ttl_s=3.0, renew_s=1.0)
    with pytest.raises(RuntimeError):
        lease.renewed(1, 0.0)
    lease.acquired(1, 0.0)
    with pytest.raises(RuntimeError):
        lease.acquired(2, 0.0)
