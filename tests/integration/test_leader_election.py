"""Conductor leader election over a real nats-server's JetStream key-value lease.

Each test uses its own bucket (the server is shared by the session) and short leases
(TTL 2 s, renewal 0.5 s); bounds are generous for a loaded machine, but the safety bound
(nobody leads while a live lease exists) is checked tightly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import nats
import pytest

from services.conductor.__main__ import Intake
from services.conductor.args import ConductorSettings
from services.conductor.handlers import Conductor
from services.conductor.leader import KEY, Election
from shared import bus, errors, subjects
from shared.messages import (Ack, GenerateRequest, InstanceInfo, Placement, Role,
                             SamplingParams)
from shared.natsd import EmbeddedNats
from tests.conftest import free_port

TTL_S, RENEW_S = 2.0, 0.5


class Candidate:
    """One conductor's election, with its elected/deposed moments recorded."""

    def __init__(self, nc, name: str, bucket: str) -> None:
        self.nc = nc
        self.name = name
        self.events: list[tuple[str, float]] = []
        self.election = Election(nc, name, TTL_S, RENEW_S, on_elected=self._elected,
                                 on_deposed=self._deposed, bucket=bucket)
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def _elected(self) -> None:
        self.events.append(("elected", time.monotonic()))

    async def _deposed(self) -> None:
        self.events.append(("deposed", time.monotonic()))

    def start(self) -> "Candidate":
        self.task = asyncio.create_task(self.election.run(self.stop))
        return self

    async def halt(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 5)

    def when(self, kind: str) -> list[float]:
        return [t for k, t in self.events if k == kind]


async def wait_for(cond, timeout_s: float, step_s: float = 0.02) -> float:
    """Poll `cond` until true; returns the monotonic time it became true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        await asyncio.sleep(step_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


@pytest.fixture
def bucket() -> str:
    return f"lease_test_{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def conns(nats_url, bucket):
    opened = []

    async def connect():
        nc = await nats.connect(nats_url)
        opened.append(nc)
        return nc

    yield connect
    if opened and opened[0].is_connected:
        await opened[0].jetstream().delete_key_value(bucket)
    for nc in opened:
        if not nc.is_closed:
            await nc.close()


async def test_one_leader_among_three_candidates(conns, bucket):
    cands = [Candidate(await conns(), f"c{i}", bucket).start() for i in range(3)]
    leaders_seen: list[int] = []
    t_end = time.monotonic() + 3 * TTL_S  # long enough for several renewals
    while time.monotonic() < t_end:
        leaders_seen.append(sum(c.election.is_leader for c in cands))
        await asyncio.sleep(0.02)
    assert max(leaders_seen) == 1, "two conductors led at the same time"
    first = leaders_seen.index(1)
    assert first * 0.02 < TTL_S, "nobody was elected promptly"
    assert all(n == 1 for n in leaders_seen[first:]), "leadership flapped"
    assert sum(len(c.when("elected")) for c in cands) == 1  # one term, renewed throughout
    leader = next(c for c in cands if c.election.is_leader)
    assert leader.election.term > 0
    for c in cands:
        await c.halt()
    assert not any(c.election.is_leader for c in cands)


async def test_a_standby_takes_over_when_the_leader_stops_renewing(conns, bucket):
    frozen = Candidate(await conns(), "frozen", bucket)
    await frozen.election.step()  # driven by hand: it acquires once, then never renews
    assert frozen.election.is_leader
    last_write = time.monotonic()
    others = [Candidate(await conns(), f"s{i}", bucket).start() for i in range(2)]
    taken_at = await wait_for(lambda: any(c.election.is_leader for c in others), TTL_S + 2.5)
    print(f"takeover {taken_at - last_write:.2f}s after the leader's last write (TTL {TTL_S}s)")
    # Safety: the lease was not taken while it lived (the server stored it after last_write).
    assert taken_at - last_write >= TTL_S - 0.05
    assert taken_at - last_write <= TTL_S + 2.0
    assert sum(c.election.is_leader for c in others) == 1
    # The old leader wakes up: its own clock deposes it before it writes anything.
    await frozen.election.step()
    assert not frozen.election.is_leader and len(frozen.when("deposed")) == 1
    await frozen.election.step()  # and it cannot campaign its way back in
    assert not frozen.election.is_leader
    for c in others:
        await c.halt()


async def test_a_graceful_leader_hands_over_without_waiting_for_the_ttl(conns, bucket):
    first = Candidate(await conns(), "first", bucket).start()
    await wait_for(lambda: first.election.is_leader, TTL_S)
    second = Candidate(await conns(), "second", bucket).start()
    await asyncio.sleep(RENEW_S)
    assert not second.election.is_leader
    t0 = time.monotonic()
    await first.halt()  # resigns: deletes its lease
    took = await wait_for(lambda: second.election.is_leader, TTL_S) - t0
    print(f"handover after resign: {took:.2f}s")
    assert took < TTL_S * 0.75
    await second.halt()


async def test_a_leader_whose_lease_is_overwritten_steps_down_at_once(conns, bucket):
    leader = Candidate(await conns(), "leader", bucket).start()
    await wait_for(lambda: leader.election.is_leader, TTL_S)
    old_term = leader.election.term
    kv = await (await conns()).jetstream().key_value(bucket)
    await kv.put(KEY, b"intruder")  # as if our lease had lapsed and someone else took it
    t0 = time.monotonic()
    await wait_for(lambda: not leader.election.is_leader, RENEW_S + 1.0)
    assert leader.when("deposed") and leader.when("deposed")[0] - t0 <= RENEW_S + 1.0
    # It waits for the intruder's entry to expire, then wins a new, later term.
    await wait_for(lambda: leader.election.is_leader, TTL_S + 2.5)
    assert leader.election.term > old_term
    await leader.halt()


async def test_a_leader_that_cannot_reach_nats_steps_down_by_its_clock(tmp_path, bucket):
    server = EmbeddedNats(tmp_path / "nats", port=free_port())
    async def quiet(exc: Exception) -> None:  # reconnect refusals are the point here
        pass

    nc = await nats.connect(server.start(), max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                            error_cb=quiet)
    try:
        leader = Candidate(nc, "leader", bucket).start()
        await wait_for(lambda: leader.election.is_leader, TTL_S)
        await asyncio.sleep(RENEW_S * 1.5)  # a few renewals in
        server.stop()
        killed = time.monotonic()
        gone = await wait_for(lambda: not leader.election.is_leader, TTL_S + 1.0) - killed
        print(f"stepped down {gone:.2f}s after NATS went away (TTL {TTL_S}s)")
        # Its last renewal was at most one period before the kill; it must stop before the
        # server could have expired that renewal (ttl after it), and not much earlier.
        assert TTL_S - 1.5 * RENEW_S - 0.1 <= gone <= TTL_S - RENEW_S / 2 + 0.3
        await asyncio.sleep(RENEW_S * 2)
        assert not leader.election.is_leader  # no campaign can succeed without the server
        # The server comes back (its in-memory lease bucket lost): leading resumes.
        server.start()
        await wait_for(lambda: leader.election.is_leader, TTL_S + 5.0)
        assert len(leader.when("elected")) == 2
        await leader.halt()
    finally:
        server.stop()
        with contextlib.suppress(ConnectionError):  # closing a client mid-reconnect
            await nc.close()


async def test_a_bucket_with_a_shorter_ttl_shortens_the_leaders_deadline(conns, bucket):
    nc = await conns()
    await nc.jetstream().create_key_value(bucket=bucket, ttl=1.0)  # made with other settings
    leader = Candidate(nc, "leader", bucket)
    await leader.election.step()
    assert leader.election.is_leader
    assert leader.election.lease.ttl_s == pytest.approx(1.0)  # not TTL_S: the bucket's
    assert leader.election.lease.valid_until - time.monotonic() <= 1.0 - RENEW_S / 2
    await leader.election.resign()


# -- the conductor: only the leader takes schedule requests ------------------------------


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=4), arrival_time=time.time())


class RunningConductor:
    """A Conductor with its Intake and Election, as services.conductor wires them."""

    def __init__(self, nc, name: str, bucket: str) -> None:
        settings = ConductorSettings(heartbeat_expiry_s=5.0, dispatch_timeout_s=1.0)
        self.conductor = Conductor(settings, nc, records=None)
        self.served: list[str] = []
        place = self.conductor.place

        async def counting_place(req):  # which conductor placed what
            self.served.append(req.request_id)
            return await place(req)

        self.conductor.place = counting_place  # type: ignore[method-assign]
        intake = Intake(nc, self.conductor)
        self.election = Election(nc, name, TTL_S, RENEW_S, intake.open, intake.close,
                                 bucket=bucket)
        self.conductor.leading = lambda: self.election.is_leader
        self.nc, self.stop = nc, asyncio.Event()

    async def start(self) -> "RunningConductor":
        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.conductor.on_heartbeat)
        self.task = asyncio.create_task(self.election.run(self.stop))
        return self


async def test_only_the_leader_places_and_a_standby_takes_over(conns, bucket):
    client = await conns()

    async def on_submit(msg):
        await bus.respond(msg, Ack())

    await client.subscribe(subjects.prefill_submit("p0"), cb=on_submit)
    a = await RunningConductor(await conns(), "a", bucket).start()
    await wait_for(lambda: a.election.is_leader, TTL_S)
    b = await RunningConductor(await conns(), "b", bucket).start()

    async def beat_forever():  # the workers' heartbeats, every conductor hears them
        while True:
            for iid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
                info = InstanceInfo(instance_id=iid, role=role, sent_at=time.time())
                await client.publish(subjects.heartbeat(role.value, iid), info.encode())
            await asyncio.sleep(0.5)

    beats = asyncio.create_task(beat_forever())
    await asyncio.sleep(0.2)
    for i in range(5):
        placed = await bus.request(client, subjects.CONDUCTOR_SCHEDULE, request(f"r{i}"),
                                   Placement, 2)
        assert placed.prefill_id == "p0"
    assert (len(a.served), len(b.served)) == (5, 0)
    # The leader's process dies: its connection (and subscription) goes with it.
    await a.nc.close()
    died = time.monotonic()
    await asyncio.sleep(0.2)  # the server notices the closed socket
    assert not b.election.is_leader  # a's lease still lives: nobody places now
    with pytest.raises(errors.Unavailable) as exc:
        await bus.request(client, subjects.CONDUCTOR_SCHEDULE, request("gap"), Placement, 2)
    assert exc.value.code == "no_responders"  # what the gateway retries on
    took = await wait_for(lambda: b.election.is_leader, TTL_S + 2.5) - died
    print(f"standby leads {took:.2f}s after the leader died")
    placed = await bus.request(client, subjects.CONDUCTOR_SCHEDULE, request("after"), Placement, 2)
    assert placed.prefill_id == "p0" and b.served == ["after"]  # its registry was warm
    b.stop.set()
    await asyncio.wait_for(b.task, 5)
    with pytest.raises(errors.Unavailable):  # resigned: it unsubscribed
        await bus.request(client, subjects.CONDUCTOR_SCHEDULE, request("late"), Placement, 1)
    a.task.cancel()
    beats.cancel()
