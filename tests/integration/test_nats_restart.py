"""A NATS restart (killed, started again on the same port and JetStream store) is survived:
connections come back by themselves, their subscriptions resume, and the KV manager's
follow of the KV event stream picks up again, missing nothing published meanwhile."""

from __future__ import annotations

import time

import pytest

from services.kvmanager.stream import ensure_stream, replay_and_follow
from shared import bus, subjects
from shared.messages import Ack, CancelRequest
from shared.natsd import EmbeddedNats
from shared.settings import BaseSettings
from tests.waiting import until


@pytest.fixture
def server(tmp_path):
    n = EmbeddedNats(tmp_path / "nats")
    n.start()
    yield n
    n.stop()


async def test_connections_subscriptions_and_the_kv_stream_resume(server):
    settings = BaseSettings(nats_url=server.url)
    worker = await bus.connect(settings, "worker")
    client = await bus.connect(settings, "client")
    kvm = await bus.connect(settings, "kvmanager")
    events: list[bytes] = []

    async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
        events.append(msg.data)

    async def on_ping(msg) -> None:  # type: ignore[no-untyped-def]
        await bus.respond(msg, Ack())

    await worker.subscribe("halfmoon.test.ping", cb=on_ping)
    await ensure_stream(kvm, 3600, 1 << 30)
    await replay_and_follow(kvm, on_event)
    await client.publish(subjects.KV_EVENTS, b"before")
    await until(lambda: events == [b"before"], 30)

    server.proc.kill()  # SIGKILL: no goodbye to anyone
    server.proc.wait()
    await until(lambda: not client.is_connected, 30)
    # published while the server is down: buffered by the client, sent on reconnect
    await client.publish(subjects.KV_EVENTS, b"during")
    server.port = int(server.url.rsplit(":", 1)[1])
    server.start()
    t0 = time.monotonic()
    await until(lambda: all(c.is_connected for c in (worker, client, kvm)), 30)
    back = time.monotonic() - t0
    # A reconnect writes the subscriptions again before anything else; a flush's PONG comes
    # after the server has taken them, so the ping below finds its responder.
    await worker.flush(timeout=30)
    assert isinstance(
        await bus.request(client, "halfmoon.test.ping", CancelRequest(request_id="x"), Ack, 10.0),
        Ack,
    )
    await client.publish(subjects.KV_EVENTS, b"after")
    t0 = time.monotonic()
    await until(lambda: b"after" in events, 30)
    resumed = time.monotonic() - t0
    assert events == [b"before", b"during", b"after"]  # in order, none twice
    print(f"reconnected in {back:.2f}s; KV stream followed again {resumed:.1f}s later")
    for c in (worker, client, kvm):
        await bus.close(c)
