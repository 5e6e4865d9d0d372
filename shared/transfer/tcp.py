"""KV transfer over TCP: framed, checksummed, with timeouts.

    receiver → sender   MAGIC | u16 id_len | transfer id
    sender → receiver   MAGIC | u8 status | u32 meta_len | u64 payload_len | u64 xxh3 | meta
                        | zeros up to a multiple of 64 bytes | payload
    receiver → sender   u8 ack (1: verified)

The sender keeps the payload until the receiver acknowledges a verified copy, so a
failed transfer never loses the only copy before the receiver has another.

Both ends drive non-blocking sockets with the loop's sock_* calls rather than streams:
streams copy every byte twice more on the receive side (into the reader's buffer, then
out of it) and, on 3.11, re-buffer and memmove unsent data on the send side. Here the
payload goes from the sender's buffer straight into the kernel, and from the kernel
straight into the receiver's final bytearray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Callable

import xxhash

from shared.messages import KVHandle
from shared.transfer.base import KVReceiver, KVSender, TransferFailed, TransferState

log = logging.getLogger(__name__)

MAGIC = b"HMKV"
_REQ = struct.Struct("<4sH")
_HDR = struct.Struct("<4sBIQQ")
STATUS_OK, STATUS_UNKNOWN = 0, 1
# Receive step: small enough that each piece is hashed while still in cache, large enough
# that the per-call overhead is noise (64 calls for 64 MiB).
CHUNK = 1 << 20
# The payload starts at a stream offset that is a multiple of this, so the kernel's copies
# (sender → socket buffer → receiver) run between equally aligned addresses: a 37-byte
# header before 64 MiB made loopback take 29 ms instead of 13 here.
ALIGN = 64


class _Offer:
    __slots__ = ("meta", "payload", "checksum", "expiry")

    def __init__(self, meta: bytes, payload: memoryview, checksum: int,
                 expiry: asyncio.TimerHandle):
        self.meta, self.payload, self.checksum, self.expiry = meta, payload, checksum, expiry


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay on the small control messages.

    Socket buffer sizes are left to the kernel: fixed 4 MiB buffers made no difference on
    loopback here, and setting SO_RCVBUF turns off autotuning (up to tcp_rmem's 32 MiB),
    which a long cross-host link needs.
    """
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _padding(meta_len: int) -> int:
    return -(_HDR.size + meta_len) % ALIGN


async def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    await recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


async def recv_into_exact(sock: socket.socket, view: memoryview, hasher=None) -> None:
    """Fill `view` from the socket; feed each piece to `hasher` while it is cache-hot."""
    loop = asyncio.get_running_loop()
    got, total = 0, len(view)
    while got < total:
        n = await loop.sock_recv_into(sock, view[got:got + CHUNK])
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {total} bytes")
        if hasher is not None:
            hasher.update(view[got:got + n])
        got += n


async def connect(host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError = OSError(f"cannot resolve {host}:{port}")
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        tune_socket(sock)
        try:
            await loop.sock_connect(sock, addr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last


class TcpKVSender(KVSender):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "") -> None:
        super().__init__()
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self._offers: dict[str, _Offer] = {}
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._listener = socket.create_server((self.host, self.port), backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept_loop())
        log.info("KV sender listening on %s:%d", self.host, self.port)

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._conns) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for tid in list(self._offers):
            await self._drop(tid, TransferState.FAILED)

    @property
    def pending(self) -> int:
        return len(self._offers)

    def offer(self, transfer_id: str, meta: bytes, payload: memoryview | bytes,
              num_tokens: int, ttl_s: float) -> KVHandle:
        # Hashing at offer time (xxh3: ~3 ms for 64 MiB here) pins the checksum to the bytes as offered,
        # so a producer that reuses its buffer too early shows up as a mismatch, not bad KV.
        view = memoryview(payload).cast("B")
        return self._register(transfer_id, meta, view, xxhash.xxh3_64_intdigest(view),
                              num_tokens, ttl_s)

    def _register(self, transfer_id: str, meta: bytes, view: memoryview, checksum: int,
                  num_tokens: int, ttl_s: float) -> KVHandle:
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(ttl_s, lambda: asyncio.ensure_future(
            self._drop(transfer_id, TransferState.FAILED)))
        self._offers[transfer_id] = _Offer(meta, view, checksum, expiry)
        self.states.set_initial(transfer_id, TransferState.WAITING)
        return KVHandle(transfer_id=transfer_id, host=self.advertise_host, port=self.port,
                        nbytes=len(view), num_tokens=num_tokens)

    async def withdraw(self, transfer_id: str) -> None:
        await self._drop(transfer_id, TransferState.FAILED)

    async def _drop(self, transfer_id: str, state: TransferState) -> None:
        offer = self._offers.pop(transfer_id, None)
        if offer is not None:
            offer.expiry.cancel()
            if self.states.get(transfer_id) not in (TransferState.DONE, TransferState.FAILED):
                await self.states.set(transfer_id, state)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                log.warning("KV sender cannot accept: %s", exc)
                await asyncio.sleep(0.1)
                continue
            tune_socket(conn)
            task = asyncio.create_task(self._serve_conn(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve_conn(self, conn: socket.socket) -> None:
        tid = ""
        try:
            magic, id_len = _REQ.unpack(await recv_exact(conn, _REQ.size))
            tid = (await recv_exact(conn, id_len)).decode()
            await self._serve(conn, magic, tid)
        except (OSError, asyncio.IncompleteReadError, UnicodeDecodeError, TransferFailed) as exc:
            log.warning("KV transfer %s failed on the sender: %s", tid or "?", exc)
            if tid:
                await self._drop(tid, TransferState.FAILED)
        finally:
            conn.close()

    async def _serve(self, conn: socket.socket, magic: bytes, tid: str) -> None:
        """One request; subclasses add other request kinds by magic."""
        if magic != MAGIC:
            return
        offer = self._offers.get(tid)
        loop = asyncio.get_running_loop()
        if offer is None:
            await loop.sock_sendall(conn, _HDR.pack(MAGIC, STATUS_UNKNOWN, 0, 0, 0))
            return
        await self.states.set(tid, TransferState.TRANSFERRING)
        head = _HDR.pack(MAGIC, STATUS_OK, len(offer.meta), len(offer.payload), offer.checksum)
        await loop.sock_sendall(conn, head + offer.meta + bytes(_padding(len(offer.meta))))
        for start in range(0, len(offer.payload), CHUNK):
            await loop.sock_sendall(conn, offer.payload[start:start + CHUNK])
        ack = await recv_exact(conn, 1)
        await self._drop(tid, TransferState.DONE if ack == b"\x01" else TransferState.FAILED)


class TcpKVReceiver(KVReceiver):
    """Fetches over TCP into a new bytearray, or into what `allocate(nbytes)` returns.

    A fresh 64 MiB bytearray costs ~35 ms of zero-filled page faults here, more than the
    loopback copy itself; a caller that recycles its buffers (and knows when it is done
    with one) can pass an allocator that hands them out (a writable buffer of nbytes).
    """

    def __init__(self, allocate: Callable[[int], bytearray | memoryview] = bytearray) -> None:
        super().__init__()
        self.allocate = allocate

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
        loop = asyncio.get_running_loop()
        sock = await connect(handle.host, handle.port)
        try:
            tid = handle.transfer_id.encode()
            await loop.sock_sendall(sock, _REQ.pack(MAGIC, len(tid)) + tid)
            magic, status, meta_len, payload_len, checksum = _HDR.unpack(
                await recv_exact(sock, _HDR.size))
            if magic != MAGIC or status != STATUS_OK:
                raise TransferFailed("unknown or expired transfer id")
            await self.states.set(handle.transfer_id, TransferState.TRANSFERRING)
            meta = (await recv_exact(sock, meta_len + _padding(meta_len)))[:meta_len]
            payload = self.allocate(payload_len)
            view = memoryview(payload).cast("B")
            if len(view) != payload_len:
                raise TransferFailed(f"allocate({payload_len}) gave {len(view)} bytes")
            hasher = xxhash.xxh3_64()
            await recv_into_exact(sock, view, hasher)
            if hasher.intdigest() != checksum:
                await loop.sock_sendall(sock, b"\x00")
                raise TransferFailed("checksum mismatch")
            await loop.sock_sendall(sock, b"\x01")
            return meta, payload
        finally:
            sock.close()
