"""KV transfer over TCP (asyncio streams): framed, checksummed, with timeouts.

    receiver → sender   MAGIC | u16 id_len | transfer id
    sender → receiver   MAGIC | u8 status | u32 meta_len | u64 payload_len | u64 xxh3 | meta | payload
    receiver → sender   u8 ack (1: verified)

The sender keeps the payload until the receiver acknowledges a verified copy, so a
failed transfer never loses the only copy before the receiver has another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct

import xxhash

from shared.messages import KVHandle
from shared.transfer.base import KVReceiver, KVSender, TransferFailed, TransferState

log = logging.getLogger(__name__)

MAGIC = b"HMKV"
_REQ = struct.Struct("<4sH")
_HDR = struct.Struct("<4sBIQQ")
STATUS_OK, STATUS_UNKNOWN = 0, 1
CHUNK = 4 << 20


class _Offer:
    __slots__ = ("meta", "payload", "expiry")

    def __init__(self, meta: bytes, payload: memoryview | bytes, expiry: asyncio.TimerHandle):
        self.meta, self.payload, self.expiry = meta, payload, expiry


class TcpKVSender(KVSender):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "") -> None:
        super().__init__()
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self._offers: dict[str, _Offer] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("KV sender listening on %s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for tid in list(self._offers):
            await self._drop(tid, TransferState.FAILED)

    @property
    def pending(self) -> int:
        return len(self._offers)

    def offer(self, transfer_id: str, meta: bytes, payload: memoryview | bytes,
              num_tokens: int, ttl_s: float) -> KVHandle:
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(ttl_s, lambda: asyncio.ensure_future(
            self._drop(transfer_id, TransferState.FAILED)))
        self._offers[transfer_id] = _Offer(meta, payload, expiry)
        self.states.set_initial(transfer_id, TransferState.WAITING)
        return KVHandle(transfer_id=transfer_id, host=self.advertise_host, port=self.port,
                        nbytes=len(payload), num_tokens=num_tokens)

    async def _drop(self, transfer_id: str, state: TransferState) -> None:
        offer = self._offers.pop(transfer_id, None)
        if offer is not None:
            offer.expiry.cancel()
            if self.states.get(transfer_id) not in (TransferState.DONE, TransferState.FAILED):
                await self.states.set(transfer_id, state)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tid = ""
        try:
            magic, id_len = _REQ.unpack(await reader.readexactly(_REQ.size))
            if magic != MAGIC:
                return
            tid = (await reader.readexactly(id_len)).decode()
            offer = self._offers.get(tid)
            if offer is None:
                writer.write(_HDR.pack(MAGIC, STATUS_UNKNOWN, 0, 0, 0))
                await writer.drain()
                return
            await self.states.set(tid, TransferState.TRANSFERRING)
            await self._send(writer, offer)
            ack = await reader.readexactly(1)
            await self._drop(tid, TransferState.DONE if ack == b"\x01" else TransferState.FAILED)
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.warning("KV transfer %s failed on the sender: %s", tid or "?", exc)
            if tid:
                await self._drop(tid, TransferState.FAILED)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, offer: _Offer) -> None:
        payload = memoryview(offer.payload).cast("B")
        checksum = xxhash.xxh3_64_intdigest(payload)
        writer.write(_HDR.pack(MAGIC, STATUS_OK, len(offer.meta), len(payload), checksum))
        writer.write(offer.meta)
        for start in range(0, len(payload), CHUNK):
            writer.write(payload[start:start + CHUNK])
            await writer.drain()
        await writer.drain()


class TcpKVReceiver(KVReceiver):
    async def fetch(self, handle: KVHandle, timeout_s: float) -> tuple[bytes, bytearray]:
        tid = handle.transfer_id
        await self.states.set(tid, TransferState.WAITING)
        try:
            result = await asyncio.wait_for(self._fetch(handle), timeout_s)
        except asyncio.TimeoutError as exc:
            await self.states.set(tid, TransferState.FAILED)
            raise TransferFailed(f"transfer {tid} timed out after {timeout_s:.1f}s") from exc
        except (OSError, asyncio.IncompleteReadError, TransferFailed) as exc:
            await self.states.set(tid, TransferState.FAILED)
            raise TransferFailed(f"transfer {tid} from {handle.host}:{handle.port}: {exc}") from exc
        await self.states.set(tid, TransferState.DONE)
        return result

    async def _fetch(self, handle: KVHandle) -> tuple[bytes, bytearray]:
        reader, writer = await asyncio.open_connection(handle.host, handle.port)
        try:
            tid = handle.transfer_id.encode()
            writer.write(_REQ.pack(MAGIC, len(tid)) + tid)
            await writer.drain()
            magic, status, meta_len, payload_len, checksum = _HDR.unpack(
                await reader.readexactly(_HDR.size))
            if magic != MAGIC or status != STATUS_OK:
                raise TransferFailed("unknown or expired transfer id")
            await self.states.set(handle.transfer_id, TransferState.TRANSFERRING)
            meta = await reader.readexactly(meta_len)
            payload = await _read_into(reader, payload_len)
            if xxhash.xxh3_64_intdigest(payload) != checksum:
                writer.write(b"\x00")
                raise TransferFailed("checksum mismatch")
            writer.write(b"\x01")
            await writer.drain()
            return meta, payload
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _read_into(reader: asyncio.StreamReader, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        chunk = await reader.read(min(CHUNK, nbytes - got))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:got]), nbytes)
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return buf
