"""Conductor leader election over a real nats-server's JetStream key-value lease.

Each test uses its own bucket (the server is shared by the session) and short leases
(TTL 2 s, renewal 0.5 s); bounds are generous for a loaded machine, but the safety bound
(nobody leads while a live lease exists) is checked tightly. What a test waits for is a
condition, never a stretch of time: a candidate's campaigns and renewals are counted, and
"it acted at its deadline" allows for how late this loop's timers are seen to fire.
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
from shared.messages import Ack, InstanceInfo, Placement, Role
from shared.natsd import EmbeddedNats
from tests.factories import request
from tests.waiting import until

TTL_S, RENEW_S = 2.0, 0.5
STARTED: list = []  # elections still running, stopped after each test whatever happened


@pytest.fixture(autouse=True)
async def stop_every_election():
    yield
    while STARTED:
        running = STARTED.pop()
        running.stop.set()
        if running.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running.task, 10)


class TimerLag:
    """How late this event loop's timers fire while a test runs (a loaded machine's
    scheduling delay): the allowance for "it acted at its deadline"."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s, self.max_s = period_s, 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.period_s)
            self.max_s = max(self.max_s, time.monotonic() - t0 - self.period_s)

    async def stop(self) -> float:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        return self.max_s


class Candidate:
    """One conductor's election, with its elected/deposed moments recorded."""

    def __init__(self, nc, name: str, bucket: str) -> None:
        self.nc = nc
        self.name = name
        self.events: list[tuple[str, float]] = []
        self.election = Election(
            nc,
            name,
            TTL_S,
            RENEW_S,
            on_elected=self._elected,
            on_deposed=self._deposed,
            bucket=bucket,
        )
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.steps = 0  # campaign or renewal attempts finished
        self.elected_at_step: list[int] = []  # the attempt (1-based) that won each term
        self.deposed_at_step: list[int] = []
        self.deadlines: list[float] = []  # valid_until after each acquire or renewal
        step, lease = self.election.step, self.election.lease
        acquired, renewed = lease.acquired, lease.renewed

        async def counted() -> None:
            try:
                await step()
            finally:
                self.steps += 1

        def noted(change):  # type: ignore[no-untyped-def]
            def record(*args):  # type: ignore[no-untyped-def]
                changed = change(*args)
                self.deadlines.append(lease.valid_until)
                return changed

            return record

        self.election.step = counted  # type: ignore[method-assign]
        lease.acquired, lease.renewed = noted(acquired), noted(renewed)  # type: ignore

    async def _elected(self) -> None:
        self.events.append(("elected", time.monotonic()))
        self.elected_at_step.append(self.steps + 1)

    async def _deposed(self) -> None:
        self.events.append(("deposed", time.monotonic()))
        self.deposed_at_step.append(self.steps + 1)

    def start(self) -> Candidate:
        self.task = asyncio.create_task(self.election.run(self.stop))
        STARTED.append(self)
        return self

    async def halt(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 5)

    def when(self, kind: str) -> list[float]:
        return [t for k, t in self.events if k == kind]


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
    assert all(n == 1 for n in leaders_seen[first:]), "leadership flapped"
    assert sum(len(c.when("elected")) for c in cands) == 1  # one term, renewed throughout
    leader = next(c for c in cands if c.election.is_leader)
    assert leader.election.term > 0
    # Promptly: nothing to wait for in a fresh bucket, so its first campaign won (or the
    # second, should the three racing to create the bucket have failed the first).
    assert leader.elected_at_step[0] <= 2, leader.elected_at_step
    for c in cands:
        await c.halt()
    assert not any(c.election.is_leader for c in cands)


async def test_a_standby_takes_over_when_the_leader_stops_renewing(conns, bucket):
    frozen = Candidate(await conns(), "frozen", bucket)
    await frozen.election.step()  # driven by hand: it acquires once, then never renews
    assert frozen.election.is_leader
    last_write = time.monotonic()
    others = [Candidate(await conns(), f"s{i}", bucket).start() for i in range(2)]
    await until(lambda: any(c.election.is_leader for c in others), TTL_S + 2.5)
    taken_at = time.monotonic()
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
    await until(lambda: first.election.is_leader, TTL_S)
    second = Candidate(await conns(), "second", bucket).start()
    await until(lambda: second.steps >= 2, TTL_S * 5)  # it campaigned, and lost
    assert not second.election.is_leader
    # The server keeps first's entry until ttl after its last renewal was sent, which is
    # no earlier than half a renewal period past first's own deadline.
    expires = first.deadlines[-1] + RENEW_S / 2
    t0 = time.monotonic()
    await first.halt()  # resigns: deletes its lease
    await until(lambda: second.election.is_leader, TTL_S * 5)
    took = time.monotonic() - t0
    print(
        f"handover after resign: {took:.2f}s; the lease would have lived {expires - t0:.2f}s more"
    )
    assert t0 + took < expires, "the standby waited for the lease to expire"
    await second.halt()


async def test_a_leader_whose_lease_is_overwritten_steps_down_at_once(conns, bucket):
    leader = Candidate(await conns(), "leader", bucket).start()
    await until(lambda: leader.election.is_leader, TTL_S)
    old_term = leader.election.term
    kv = await (await conns()).jetstream().key_value(bucket)
    put_at_step = leader.steps
    await kv.put(KEY, b"intruder")  # as if our lease had lapsed and someone else took it
    await until(lambda: not leader.election.is_leader, TTL_S * 5)
    # At its next renewal (the one on its way meanwhile may still have gone through), not
    # by its clock when the lease runs out.
    assert leader.deposed_at_step[0] - put_at_step <= 2, (put_at_step, leader.deposed_at_step)
    assert leader.when("deposed")[0] < leader.deadlines[-1]
    # It waits for the intruder's entry to expire, then wins a new, later term.
    await until(lambda: leader.election.is_leader, TTL_S * 5)
    assert leader.election.term > old_term
    await leader.halt()


async def test_a_leader_that_cannot_reach_nats_steps_down_by_its_clock(tmp_path, bucket):
    server = EmbeddedNats(tmp_path / "nats")

    async def quiet(exc: Exception) -> None:  # reconnect refusals are the point here
        pass

    url = server.start()
    server.port = int(url.rsplit(":", 1)[1])  # it comes back on the same port
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet)
    try:
        leader = Candidate(nc, "leader", bucket).start()
        await until(lambda: leader.election.is_leader, TTL_S * 5)
        await until(lambda: len(leader.deadlines) >= 3, TTL_S * 5)  # a few renewals in
        lag = TimerLag()
        server.stop()
        killed = time.monotonic()
        await until(lambda: not leader.election.is_leader, TTL_S * 5)
        late_s = await lag.stop()
        deadline, gone = leader.deadlines[-1], leader.when("deposed")[0]
        print(
            f"stepped down {gone - killed:.2f}s after NATS went away (TTL {TTL_S}s), "
            f"{gone - deadline:+.3f}s from its deadline; timers fired up to "
            f"{late_s * 1e3:.0f} ms late"
        )
        # By its own clock: never before the deadline of its last renewal (the lease still
        # lives), and at that deadline, allowing for this loop's timer lag; the server may
        # expire the renewal half a renewal period later, so that is the hard bound.
        assert deadline <= gone <= deadline + 2 * late_s + 0.05
        assert gone < deadline + RENEW_S / 2
        campaigns = leader.steps
        await until(lambda: leader.steps >= campaigns + 2, 60)
        assert not leader.election.is_leader  # no campaign can succeed without the server
        # The server comes back (its in-memory lease bucket lost): leading resumes.
        server.start()
        await until(lambda: leader.election.is_leader, 60)
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
        self.election = Election(nc, name, TTL_S, RENEW_S, intake.open, intake.close, bucket=bucket)
        self.conductor.leading = lambda: self.election.is_leader
        self.nc, self.stop = nc, asyncio.Event()
        self.task: asyncio.Task | None = None

    async def start(self) -> RunningConductor:
        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.conductor.on_heartbeat)
        self.task = asyncio.create_task(self.election.run(self.stop))
        STARTED.append(self)
        return self

    def heard(self, *ids: str) -> bool:
        return {s.info.instance_id for s in self.conductor.registry.all()} >= set(ids)


async def test_only_the_leader_places_and_a_standby_takes_over(conns, bucket):
    client = await conns()

    async def on_submit(msg):
        await bus.respond(msg, Ack())

    await client.subscribe(subjects.prefill_submit("p0"), cb=on_submit)
    a = await RunningConductor(await conns(), "a", bucket).start()
    await until(lambda: a.election.is_leader, TTL_S)
    b = await RunningConductor(await conns(), "b", bucket).start()

    async def beat_forever():  # the workers' heartbeats, every conductor hears them
        while True:
            for iid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
                info = InstanceInfo(instance_id=iid, role=role, sent_at=time.time())
                await client.publish(subjects.heartbeat(role.value, iid), info.encode())
            await asyncio.sleep(0.5)

    beats = asyncio.create_task(beat_forever())
    try:
        await placing_and_taking_over(client, a, b)
    finally:
        beats.cancel()


async def placing_and_taking_over(client, a: RunningConductor, b: RunningConductor) -> None:
    await until(lambda: a.heard("p0", "d0") and b.heard("p0", "d0"), 30)
    for i in range(5):
        placed = await bus.request(
            client, subjects.CONDUCTOR_SCHEDULE, request(f"r{i}"), Placement, 2
        )
        assert placed.prefill_id == "p0"
    assert (len(a.served), len(b.served)) == (5, 0)
    # The leader's process dies: its connection (and subscription) goes with it.
    await a.nc.close()
    died = time.monotonic()
    # Until the server notices the closed socket, a request is sent into it and never
    # answered; then nobody is there (a's lease still lives: b does not lead yet).
    gap = None
    while gap is None:
        try:
            await bus.request(client, subjects.CONDUCTOR_SCHEDULE, request("gap"), Placement, 0.2)
            raise AssertionError("a request was placed while nobody led")
        except errors.Timeout:
            assert time.monotonic() - died < TTL_S, "the closed connection was not noticed"
        except errors.Unavailable as exc:
            gap = exc
    assert not b.election.is_leader
    assert gap.code == "no_responders"  # what the gateway retries on
    await until(lambda: b.election.is_leader, TTL_S + 2.5)
    took = time.monotonic() - died
    print(f"standby leads {took:.2f}s after the leader died")
    placed = await bus.request(client, subjects.CONDUCTOR_SCHEDULE, request("after"), Placement, 2)
    assert placed.prefill_id == "p0" and b.served == ["after"]  # its registry was warm
    b.stop.set()
    await asyncio.wait_for(b.task, 5)
    with pytest.raises(errors.Unavailable):  # resigned: it unsubscribed
        await bus.request(client, subjects.CONDUCTOR_SCHEDULE, request("late"), Placement, 1)
