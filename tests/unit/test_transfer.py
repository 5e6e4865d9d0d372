"""The TCP data plane over real loopback sockets, plain and over mutual TLS, and the
fake's state machine."""

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import pytest

from shared import tls
from shared.transfer import TransferFailed, TransferState
from shared.transfer.fake import FakeKVReceiver, FakeKVSender
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender


@dataclass
class Plane:
    """Makes senders and receivers that all use one data-plane set-up: plain or TLS."""

    server: Any = None  # ssl.SSLContext or None
    client: Any = None

    def sender(self, **kw: Any) -> TcpKVSender:
        return TcpKVSender(tls=self.server, **kw)

    def receiver(self, **kw: Any) -> TcpKVReceiver:
        return TcpKVReceiver(tls=self.client, **kw)


@pytest.fixture(params=["plain", "tls"])
def plane(request) -> Plane:
    if request.param == "plain":
        return Plane()
    pki = request.getfixturevalue("pki")
    return Plane(*tls.kv_contexts(pki.cert, pki.key, pki.ca))


async def test_tcp_round_trip_and_states(plane):
    sender = plane.sender()
    await sender.start()
    try:
        payload = os.urandom(9 << 20)  # several chunks
        handle = sender.offer("handoff", b'{"m": 1}', payload, num_tokens=7, ttl_s=10)
        t1 = handle.transfer_id
        assert sender.state(t1) == TransferState.WAITING
        receiver = plane.receiver()
        meta, got = await receiver.fetch(handle, timeout_s=10)
        assert meta == b'{"m": 1}' and bytes(got) == payload
        assert receiver.state(t1) == TransferState.DONE
        assert await sender.wait(t1, 5) == TransferState.DONE
        assert sender.pending == 0  # the sender let go of its copy once it was verified
    finally:
        await sender.close()


async def test_unknown_transfer_fails_cleanly(plane):
    sender = plane.sender()
    await sender.start()
    try:
        handle = sender.offer("handoff", b"{}", b"x" * 10, 1, ttl_s=10)
        bogus = handle.model_copy(update={"transfer_id": "nope"})
        with pytest.raises(TransferFailed):
            await plane.receiver().fetch(bogus, timeout_s=5)
        assert sender.state(handle.transfer_id) == TransferState.WAITING  # untouched
    finally:
        await sender.close()


async def test_offer_expires(plane):
    sender = plane.sender()
    await sender.start()
    try:
        handle = sender.offer("handoff", b"{}", b"x" * 10, 1, ttl_s=0.05)
        assert await sender.wait(handle.transfer_id, 2) == TransferState.FAILED
        with pytest.raises(TransferFailed):
            await plane.receiver().fetch(handle, timeout_s=5)
    finally:
        await sender.close()


async def test_receivers_fill_the_callers_buffer(plane):
    sender = plane.sender()
    await sender.start()
    try:
        payload = os.urandom(3 << 20)
        mine = bytearray(4 << 20)
        handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
        _, got = await plane.receiver(allocate=lambda n: memoryview(mine)[:n]).fetch(handle, 10)
        assert got.obj is mine and mine[: len(payload)] == payload
    finally:
        await sender.close()


async def test_sender_gone_mid_transfer_fails_within_timeout():
    """A sender that stalls after the header: the receiver gives up at its timeout."""

    async def stalling(reader, writer):
        await reader.read(100)
        from shared.transfer.frames import HEADER, MAGIC

        writer.write(HEADER.pack(MAGIC, 0, 2, 1 << 20, 0) + b"{}" + b"x" * 1000)
        await writer.drain()
        await asyncio.sleep(30)

    server = await asyncio.start_server(stalling, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    from shared.messages import KVHandle

    receiver = TcpKVReceiver()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TransferFailed, match="timed out"):
        await receiver.fetch(
            KVHandle(transfer_id="x", host="127.0.0.1", port=port, nbytes=1 << 20, num_tokens=1),
            timeout_s=0.5,
        )
    # At its timeout: the stalled sender would hold it for 30 s. Past the timeout, 5 s of
    # room for a loaded machine's scheduling.
    assert loop.time() - t0 < 0.5 + 5.0
    assert receiver.state("x") == TransferState.FAILED
    server.close()


async def test_fake_transport_follows_the_same_states():
    sender = FakeKVSender()
    handle = sender.offer("handoff", b"{}", b"abc", 1, ttl_s=1)
    meta, got = await FakeKVReceiver(sender).fetch(handle, 1)
    assert bytes(got) == b"abc" and sender.state(handle.transfer_id) == TransferState.DONE
    with pytest.raises(TransferFailed):  # used once: gone
        await FakeKVReceiver(sender).fetch(handle, 1)
    assert sender.refusals.total == 1
    handle = sender.offer("handoff", b"{}", b"abc", 1, ttl_s=1)
    with pytest.raises(TransferFailed):
        await FakeKVReceiver(sender, fail=True).fetch(handle, 1)
    assert sender.state(handle.transfer_id) == TransferState.FAILED
