"""The TCP data plane over real loopback sockets, and the fake's state machine."""

import asyncio
import os

import pytest

from shared.transfer import TransferFailed, TransferState
from shared.transfer.fake import FakeKVReceiver, FakeKVSender
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender


async def test_tcp_round_trip_and_states():
    sender = TcpKVSender()
    await sender.start()
    try:
        payload = os.urandom(9 << 20)  # several chunks
        handle = sender.offer("t1", b'{"m": 1}', payload, num_tokens=7, ttl_s=10)
        assert sender.state("t1") == TransferState.WAITING
        receiver = TcpKVReceiver()
        meta, got = await receiver.fetch(handle, timeout_s=10)
        assert meta == b'{"m": 1}' and bytes(got) == payload
        assert receiver.state("t1") == TransferState.DONE
        assert await sender.wait("t1", 5) == TransferState.DONE
        assert sender.pending == 0  # the sender let go of its copy once it was verified
    finally:
        await sender.close()


async def test_unknown_transfer_fails_cleanly():
    sender = TcpKVSender()
    await sender.start()
    try:
        handle = sender.offer("real", b"{}", b"x" * 10, 1, ttl_s=10)
        bogus = handle.model_copy(update={"transfer_id": "nope"})
        with pytest.raises(TransferFailed):
            await TcpKVReceiver().fetch(bogus, timeout_s=5)
    finally:
        await sender.close()


async def test_offer_expires():
    sender = TcpKVSender()
    await sender.start()
    try:
        handle = sender.offer("short", b"{}", b"x" * 10, 1, ttl_s=0.05)
        assert await sender.wait("short", 2) == TransferState.FAILED
        with pytest.raises(TransferFailed):
            await TcpKVReceiver().fetch(handle, timeout_s=5)
    finally:
        await sender.close()


async def test_sender_gone_mid_transfer_fails_within_timeout():
    """A sender that stalls after the header: the receiver gives up at its timeout."""

    async def stalling(reader, writer):
        await reader.read(100)
        from shared.transfer.tcp import _HDR, MAGIC
        writer.write(_HDR.pack(MAGIC, 0, 2, 1 << 20, 0) + b"{}" + b"x" * 1000)
        await writer.drain()
        await asyncio.sleep(30)

    server = await asyncio.start_server(stalling, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    from shared.messages import KVHandle
    receiver = TcpKVReceiver()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TransferFailed, match="timed out"):
        await receiver.fetch(KVHandle(transfer_id="x", host="127.0.0.1", port=port,
                                      nbytes=1 << 20, num_tokens=1), timeout_s=0.5)
    assert loop.time() - t0 < 3
    assert receiver.state("x") == TransferState.FAILED
    server.close()


async def test_fake_transport_follows_the_same_states():
    sender = FakeKVSender()
    handle = sender.offer("f", b"{}", b"abc", 1, ttl_s=1)
    meta, got = await FakeKVReceiver(sender).fetch(handle, 1)
    assert bytes(got) == b"abc" and sender.state("f") == TransferState.DONE
    handle = sender.offer("g", b"{}", b"abc", 1, ttl_s=1)
    with pytest.raises(TransferFailed):
        await FakeKVReceiver(sender, fail=True).fetch(handle, 1)
    assert sender.state("g") == TransferState.FAILED
