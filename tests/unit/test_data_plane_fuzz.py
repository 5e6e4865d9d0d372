"""Hostile frames on the TCP data plane, against a live sender and a live receiver: each
is refused and counted, nothing is allocated for what a header only claims, and the
transfer that follows works."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest
import xxhash

from shared.messages import KVHandle
from shared.transfer import TransferFailed
from shared.transfer.frames import HEADER, MAGIC, MAX_ID_LEN, MAX_META_BYTES, REQUEST, padding
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender
from tests.waiting import until

PAYLOAD = os.urandom(1 << 16)
META = b'{"m": 1}'


def good_header(checksum: int | None = None, **sizes: int) -> bytes:
    meta_len = sizes.get("meta_len", len(META))
    return (
        HEADER.pack(
            MAGIC,
            0,
            meta_len,
            sizes.get("payload_len", len(PAYLOAD)),
            xxhash.xxh3_64_intdigest(PAYLOAD) if checksum is None else checksum,
        )
        + META
        + bytes(padding(len(META)))
    )


# What a broken or hostile sender answers a fetch with.
BAD_SENDERS = {
    "another protocol": b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64,
    "meta past the bound": good_header(meta_len=MAX_META_BYTES + 1),
    "payload larger than the offer": good_header(payload_len=len(PAYLOAD) + 1),
    "payload of 2**63 bytes": good_header(payload_len=1 << 63),
    "wrong checksum": good_header(checksum=1) + PAYLOAD,
    "header cut short": good_header()[:10],
    "payload cut short": good_header() + PAYLOAD[:100],
}


@pytest.mark.parametrize("case", sorted(BAD_SENDERS))
async def test_a_receiver_refuses_and_counts_each_bad_frame_then_fetches(case):
    async def bad_sender(reader, writer):
        await reader.read(100)  # the request
        writer.write(BAD_SENDERS[case])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(bad_sender, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sizes: list[int] = []

    def allocate(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    receiver = TcpKVReceiver(allocate)
    handle = KVHandle(
        transfer_id="bad", host="127.0.0.1", port=port, nbytes=len(PAYLOAD), num_tokens=1
    )
    try:
        with pytest.raises(TransferFailed):
            await receiver.fetch(handle, timeout_s=30)
    finally:
        server.close()
    assert receiver.bad_frames == 1
    assert all(n == len(PAYLOAD) for n in sizes)  # never what a bad header claimed
    # The same receiver, then, fetches from a real sender.
    sender = TcpKVSender()
    await sender.start()
    try:
        good = sender.offer("handoff", META, PAYLOAD, num_tokens=1, ttl_s=30)
        assert await receiver.fetch(good, timeout_s=30) == (META, bytearray(PAYLOAD))
    finally:
        await sender.close()
    assert receiver.bad_frames == 1


# What a broken or hostile receiver sends a sender.
BAD_REQUESTS = {
    "another protocol": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "id longer than any": REQUEST.pack(MAGIC, MAX_ID_LEN + 1) + b"a" * (MAX_ID_LEN + 1),
    "id of 65535 bytes announced": REQUEST.pack(MAGIC, 0xFFFF),
    "unknown id": REQUEST.pack(MAGIC, 32) + b"0" * 32,
    "request cut short": REQUEST.pack(MAGIC, 32)[:3],
    "id cut short": REQUEST.pack(MAGIC, 32) + b"0" * 5,
}


async def test_a_sender_refuses_and_counts_each_bad_request_then_serves():
    sender = TcpKVSender()
    await sender.start()
    try:
        good = sender.offer("handoff", META, PAYLOAD, num_tokens=1, ttl_s=60)
        for i, raw in enumerate(BAD_REQUESTS.values(), start=1):
            reader, writer = await asyncio.open_connection("127.0.0.1", sender.port)
            writer.write(raw)
            await writer.drain()
            writer.write_eof()
            try:  # the sender answers "unknown", or closes (a reset: it read only part)
                answer = await reader.read()
            except ConnectionResetError:
                answer = b""
            writer.close()
            if answer:
                magic, status, *_ = HEADER.unpack(answer[: HEADER.size])
                assert magic == MAGIC and status != 0
            await until(lambda i=i: sender.refusals.total >= i, what=f"refusal {i} counted")
        assert sender.refusals.total == len(BAD_REQUESTS)
        assert sender.pending == 1  # the real offer was not touched
        meta, payload = await TcpKVReceiver().fetch(good, timeout_s=30)
        assert (meta, bytes(payload)) == (META, PAYLOAD)
    finally:
        await sender.close()


def test_header_layout_is_what_the_cases_assume():
    assert HEADER.size == struct.calcsize("<4sBIQQ")
