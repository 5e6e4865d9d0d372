"""The gateway's placement call over a real nats-server while the conductor fails over.

Asking again is safe only when nobody took the request (no responders, or a deposed
leader's "not_leader"); a timeout may mean it was dispatched, so it is not retried.

Nothing here waits on the clock: each placement call's attempts are recorded (`Attempts`),
the stand-in conductor appears once the gateway has been refused, and "nothing more was
sent" is checked behind a marker sent after it on the same connection.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from services.gateway import placement
from services.gateway.args import GatewaySettings
from services.gateway.life import RequestLife
from services.gateway.metrics import GatewayMetrics
from services.gateway.placement import ConductorPlacer
from shared import bus, errors, subjects
from shared.messages import GenerateRequest, Placement
from tests.factories import request
from tests.waiting import until


@pytest.fixture
async def client(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.close()


def new_placer(nc, retry_s: float, timeout_s: float = 2.0) -> ConductorPlacer:
    settings = GatewaySettings(schedule_retry_s=retry_s, schedule_timeout_s=timeout_s)
    # No SQL: the placement call does not touch it.
    return ConductorPlacer(settings, nc, None, GatewayMetrics())


class Attempts:
    """Every placement request the gateway sends, with its outcome and how long it took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refused_after: int = 0) -> None:
        self.outcomes: list[str] = []
        self.durations: list[float] = []
        self.refused = asyncio.Event()  # set after `refused_after` refusals
        self.refused_after = refused_after
        request = bus.request

        async def recorded(*args, **kwargs):
            t0 = time.monotonic()
            try:
                reply = await request(*args, **kwargs)
            except errors.HalfmoonError as exc:
                self.outcomes.append(exc.code)
                if self.refused_after and self.outcomes.count(exc.code) >= self.refused_after:
                    self.refused.set()
                raise
            finally:
                self.durations.append(time.monotonic() - t0)
            self.outcomes.append("placed")
            return reply

        monkeypatch.setattr(placement.bus, "request", recorded)


async def behind_a_marker(nc, subject: str, got: list[str], marker: str, encoded: bytes) -> None:
    """Publish a marker after everything this connection sent on `subject`, and wait until
    the subscriber has it: one subscription's messages arrive in order, so by then it has
    seen whatever was sent before."""
    await nc.publish(subject, encoded)
    await until(lambda: marker in got, what=f"the marker on {subject}")
    got.remove(marker)


async def conductor(nc, replies: list, seen: list[str]):
    """A stand-in conductor answering with `replies` in turn (None: never answers)."""

    async def on_schedule(msg):
        seen.append(GenerateRequest.model_validate_json(msg.data).request_id)
        reply = replies.pop(0) if replies else None
        if reply is not None:
            await bus.respond(msg, reply)

    sub = await nc.subscribe(subjects.CONDUCTOR_SCHEDULE, cb=on_schedule)
    await nc.flush()
    return sub


async def test_no_conductor_fails_with_503_after_the_retry_window(client, monkeypatch):
    retry_s = 1.0
    # A long placement timeout: treating "no responders" as a silent conductor would take
    # 30 s, and asking forever would never end (wait_for turns that into a failure).
    placer = new_placer(client, retry_s=retry_s, timeout_s=30.0)
    attempts = Attempts(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable) as exc:
        await asyncio.wait_for(placer.ask_conductor(request("r-none")), 10 * retry_s + 30)
    took = time.monotonic() - t0
    assert exc.value.status == 503 and exc.value.code == "no_conductor"
    assert "no conductor is placing requests" in exc.value.message
    assert len(attempts.outcomes) >= 2 and set(attempts.outcomes) == {"no_responders"}
    # It asks until the window is over (its pauses grow to 0.5 s: it stops when the next
    # one would overrun), then gives up: a second past the window, plus ten of the slowest
    # attempts measured here, is room for a slow machine's timers.
    slack = 1.0 + 10 * max(attempts.durations)
    assert retry_s - 0.5 <= took <= retry_s + slack, (took, attempts.durations)


async def test_a_conductor_that_appears_meanwhile_gets_the_request(client, monkeypatch):
    placer = new_placer(client, retry_s=30.0)
    seen: list[str] = []
    placement = Placement(request_id="r-late", prefill_id="p0", decode_id="d0")
    attempts = Attempts(monkeypatch, refused_after=2)
    refused_before: list[int] = []

    async def late_leader():
        await attempts.refused.wait()  # the gateway has been refused twice: no leader yet
        sub = await conductor(client, [placement], seen)  # a standby takes over
        refused_before.append(len(attempts.outcomes))
        return sub

    leader, got = await asyncio.gather(late_leader(), placer.ask_conductor(request("r-late")))
    assert got.prefill_id == "p0" and seen == ["r-late"]
    assert attempts.outcomes[-1] == "placed"
    assert set(attempts.outcomes[:-1]) == {"no_responders"}
    # The leader is found by the next attempt (one may have been on its way meanwhile).
    assert 2 <= len(attempts.outcomes) - 1 <= refused_before[0] + 1, attempts.outcomes
    await leader.unsubscribe()


async def test_a_deposed_leaders_refusal_is_asked_again(client):
    placer = new_placer(client, retry_s=5.0)
    seen: list[str] = []
    sub = await conductor(
        client,
        [
            errors.Unavailable("this conductor lost the leader lease", code="not_leader"),
            Placement(request_id="r-dep", prefill_id="p1", decode_id="d1"),
        ],
        seen,
    )
    got = await placer.ask_conductor(request("r-dep"))
    assert got.prefill_id == "p1" and seen == ["r-dep", "r-dep"]
    await sub.unsubscribe()


async def test_other_refusals_and_timeouts_are_not_retried(client):
    seen: list[str] = []
    sub = await conductor(
        client, [errors.Unavailable("no live prefill and decode instances"), None], seen
    )
    with pytest.raises(errors.Unavailable) as exc:
        await new_placer(client, retry_s=5.0, timeout_s=30.0).ask_conductor(request("r-busy"))
    assert exc.value.code == "unavailable" and seen == ["r-busy"]
    # It may have been dispatched before the conductor went quiet: never placed twice.
    with pytest.raises(errors.Timeout):
        await new_placer(client, retry_s=5.0, timeout_s=0.5).ask_conductor(request("r-quiet"))
    await behind_a_marker(
        client, subjects.CONDUCTOR_SCHEDULE, seen, "marker", request("marker").encode()
    )
    assert seen == ["r-busy", "r-quiet"]
    await sub.unsubscribe()


async def test_a_placement_that_times_out_is_cancelled_and_placed_as_a_new_attempt(client):
    """The leader took the request and died before answering: the gateway cancels that id
    everywhere (it may have been dispatched late) and asks again under a new attempt id,
    which the token stream follows from its first event."""
    # The first ask is never answered; the timeout is also all the second (answered at once)
    # may take, so it is generous.
    placer = new_placer(client, retry_s=5.0, timeout_s=2.0)
    seen: list[str] = []
    cancels: list[str] = []
    retargets: list[tuple[str, int]] = []

    async def on_cancel(msg):
        cancels.append(json.loads(msg.data)["request_id"])

    csub = await client.subscribe(subjects.CANCEL, cb=on_cancel)
    sub = await conductor(
        client, [None, Placement(request_id="r-died-t1", prefill_id="p2", decode_id="d2")], seen
    )

    async def retarget(request_id: str, next_index: int) -> None:
        retargets.append((request_id, next_index))

    life = RequestLife("r-died", time.time())
    got = await placer.place(request("r-died"), life, retarget)
    await behind_a_marker(
        client, subjects.CANCEL, cancels, "marker", json.dumps({"request_id": "marker"}).encode()
    )
    assert (got.request_id, got.prefill_id) == ("r-died-t1", "p2")
    assert seen == ["r-died", "r-died-t1"] and retargets == [("r-died-t1", 0)]
    assert cancels == ["r-died"] and life.dispatch_time is not None
    await sub.unsubscribe()
    await csub.unsubscribe()
