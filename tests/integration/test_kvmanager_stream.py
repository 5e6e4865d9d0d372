"""The KV manager over a real nats-server with JetStream: index from events, rebuilt
after a restart by replaying the stream."""

from __future__ import annotations

import time

import nats
import pytest

from services.kvmanager.handlers import KVManager
from services.kvmanager.stream import STREAM, ensure_stream, replay_and_follow
from shared import bus, subjects
from shared.kv_messages import KVMatchReply, KVMatchRequest
from shared.messages import KVEvent, KVEventKind
from tests.waiting import until


async def publish(nc, kind, instance, hashes=()):
    event = KVEvent(
        kind=kind,
        instance_id=instance,
        block_hashes=list(hashes),
        block_nbytes=10,
        sent_at=time.time(),
    )
    await nc.publish(subjects.KV_EVENTS, event.encode())


async def start_manager(url):
    nc = await nats.connect(url)
    manager = KVManager()
    await ensure_stream(nc, 3600, 1 << 24)
    await replay_and_follow(nc, manager.on_event)
    sub = await nc.subscribe(subjects.KV_MATCH, queue="kvm", cb=manager.on_match)
    return nc, manager, sub


async def match(nc, hashes):
    return (
        await bus.request(
            nc, subjects.KV_MATCH, KVMatchRequest(block_hashes=hashes), KVMatchReply, 10
        )
    ).matches


@pytest.fixture
async def clean_stream(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.delete_stream(STREAM)
    except Exception:  # noqa: BLE001 - not there yet
        pass
    yield
    await nc.close()


async def test_index_is_rebuilt_after_a_restart(nats_url, clean_stream):
    nc, manager, sub = await start_manager(nats_url)
    pub = await nats.connect(nats_url)
    await publish(pub, KVEventKind.STORED, "prefill-0", [1, 2, 3, 4])
    await publish(pub, KVEventKind.STORED, "prefill-1", [1, 2])
    await publish(pub, KVEventKind.REMOVED, "prefill-0", [4])
    await pub.flush()
    await until(lambda: manager.events_applied == 3, what="3 events applied")
    assert await match(pub, [1, 2, 3, 4]) == {"prefill-0": 3, "prefill-1": 2}
    await sub.unsubscribe()
    await nc.close()  # the KV manager dies

    await publish(pub, KVEventKind.CLEARED, "prefill-1")  # while it was away
    await pub.flush()
    nc2, manager2, sub2 = await start_manager(nats_url)
    await until(lambda: manager2.events_applied >= 4, what="the replay")
    assert manager2.events_applied == 4
    assert await match(pub, [1, 2, 3, 4]) == {"prefill-0": 3}
    await sub2.unsubscribe()
    await nc2.close()
    await pub.close()
