"""Fault bookkeeping: who is dead (gateway), who must be alive for the next event, restart
backoff (halfmoon up), and how chaos classifies a request's end."""

from __future__ import annotations

from services.gateway.streams import Attempt, Liveness
from services.tools.bench.client import Result
from services.tools.chaos.load import outcome
from services.up import restart_delay
from shared.messages import InstanceInfo, Role


def info(
    iid: str,
    role: Role = Role.DECODE,
    started_at: float = 1.0,
    load: int = 0,
    status: str = "ready",
) -> InstanceInfo:
    return InstanceInfo(
        instance_id=iid, role=role, started_at=started_at, running=load, status=status
    )


def test_silence_is_death_only_while_others_are_heard():
    live = Liveness(expiry_s=3.0)
    live.beat(info("d0"), now=100.0)
    live.beat(info("gw", Role.GATEWAY), now=100.0)
    assert live.lost("d0", 1.0) is None
    # the bus is down: nobody is heard, nobody is declared dead however long it lasts
    assert live.lost("d0", 1.0) is None
    live.beat(info("gw", Role.GATEWAY), now=103.0)
    assert live.lost("d0", 1.0) is None  # exactly the expiry: still alive
    live.beat(info("gw", Role.GATEWAY), now=103.5)
    assert live.lost("d0", 1.0) == "no heartbeat for 3.5s"
    live.beat(info("d0"), now=104.0)
    assert live.lost("d0", 1.0) is None
    assert live.lost("never-seen", None) is None


def test_an_instance_silent_for_long_is_forgotten_and_one_silent_briefly_is_listed():
    live = Liveness(expiry_s=3.0)
    live.beat(info("gone"), now=100.0)
    live.beat(info("gw", Role.GATEWAY), now=110.0)
    assert [i.instance_id for i in live.infos()] == ["gone", "gw"]  # silent: still listed
    live.beat(info("gw", Role.GATEWAY), now=100.0 + live.forget_s)
    assert [i.instance_id for i in live.infos()] == ["gone", "gw"]
    live.beat(info("gw", Role.GATEWAY), now=100.5 + live.forget_s)
    assert [i.instance_id for i in live.infos()] == ["gw"]


def test_a_restarted_process_has_lost_what_the_old_one_held():
    live = Liveness(expiry_s=3.0)
    live.beat(info("d0", started_at=1.0), now=10.0)
    assert live.incarnation("d0") == 1.0
    live.beat(info("d0", started_at=7.0), now=11.0)  # same id, new process
    assert live.lost("d0", 1.0) == "restarted"
    assert live.lost("d0", 7.0) is None
    assert live.lost("d0", None) is None


def test_pick_prefers_live_idle_instances_not_avoided():
    live = Liveness(expiry_s=3.0)
    live.beat(info("d0", load=5), now=10.0)
    live.beat(info("d1", load=1), now=10.0)
    live.beat(info("d2", load=0, status="draining"), now=10.0)
    live.beat(info("p0", Role.PREFILL), now=10.0)
    assert live.pick(Role.DECODE, set()) == "d1"
    assert live.pick(Role.DECODE, {"d1"}) == "d0"
    assert live.pick(Role.DECODE, {"d0", "d1"}) == "d1"  # only avoided ones: still usable
    live.beat(info("p0", Role.PREFILL), now=20.0)  # d0 and d1 fell silent
    assert live.pick(Role.DECODE, set()) is None


def test_who_must_be_alive_for_the_next_event():
    a = Attempt("r", "p0", "d0")
    assert a.responsible(0) == ["p0"]
    assert a.responsible(1) == ["p0", "d0"]  # the handoff
    assert a.responsible(2) == ["d0"]
    assert Attempt("r-r1", "", "d1").responsible(0) == ["d1"]  # a decode re-placement
    assert Attempt("r", "c0", "").responsible(5) == ["c0"]  # colocated


def test_restart_backoff_doubles_and_is_capped():
    assert [restart_delay(n, 1.0, 30.0) for n in (1, 2, 3, 4, 5, 6, 7)] == [
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        30.0,
        30.0,
    ]
    assert restart_delay(0, 0.5, 30.0) == 0.5


def test_chaos_outcomes():
    done = Result(terminal=True, finish_reason="length", completion_tokens=8, chunk_times=[0.1] * 8)
    assert outcome(done, 8) == "completed"
    assert outcome(Result(terminal=True, error="503"), 8) == "error"
    assert outcome(Result(terminal=False, error="TimeoutError"), 8) == "hung"
    assert outcome(Result(terminal=False), 8) == "hung"
    assert outcome(Result(terminal=True), 8) == "hung"  # [DONE] but never a finish
    short = Result(terminal=True, finish_reason="length", completion_tokens=7)
    assert outcome(short, 8) == "inconsistent"
    dup = Result(terminal=True, finish_reason="length", completion_tokens=8, chunk_times=[0.1] * 9)
    assert outcome(dup, 8) == "inconsistent"
