"""KV transfer over TCP: framed, checksummed, with timeouts, optionally over mutual TLS.

    receiver → sender   MAGIC | u16 id_len | transfer id
    sender → receiver   MAGIC | u8 status | u32 meta_len | u64 payload_len | u64 xxh3 | meta
                        | zeros up to a multiple of 64 bytes | payload
    receiver → sender   u8 ack (1: verified)

The sender keeps the payload until the receiver acknowledges a verified copy, so a
failed transfer never loses the only copy before the receiver has another. The transfer
id is a single-use capability (see base.py): an unknown, used or expired one gets
STATUS_UNKNOWN and nothing else.

The frames are in frames.py; the connections they travel over, plain sockets (the
zero-copy path) or TLS streams, in channel.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from typing import Callable

import xxhash

from shared.messages import KVHandle
from shared.tls import HANDSHAKE_TIMEOUT_S
from shared.transfer.base import (
    HANDOFF,
    BadFrame,
    Capabilities,
    KVReceiver,
    KVSender,
    Payload,
    TransferFailed,
    TransferState,
    new_transfer_id,
    short_id,
)
from shared.transfer.channel import (
    Channel,
    CutShort,
    SocketChannel,
    TlsChannel,
    connect,
    host_of,
    open_channel,
    recv_into_exact,
    tune_socket,
)
from shared.transfer.frames import (
    CHUNK,
    HEADER,
    MAGIC,
    MAX_ID_LEN,
    REQUEST,
    REQUEST_TIMEOUT_S,
    STATUS_OK,
    STATUS_UNKNOWN,
    check_sizes,
    padding,
)

# The socket primitives too, for callers that time the wire itself (the transfer bench).
__all__ = ["TcpKVReceiver", "TcpKVSender", "connect", "recv_into_exact", "tune_socket"]

log = logging.getLogger(__name__)


class _Offer:
    __slots__ = ("meta", "payload", "checksum", "expiry")

    def __init__(
        self, meta: bytes, payload: memoryview, checksum: int, expiry: asyncio.TimerHandle
    ):
        self.meta, self.payload, self.checksum, self.expiry = meta, payload, checksum, expiry


class TcpKVSender(KVSender):
    """Serves offers on host:port; with `tls` (a server context that requires client
    certificates, see shared.tls), only over mutual TLS."""

    MAGICS = frozenset({MAGIC})  # request kinds served; subclasses add theirs

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str = "",
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.tls = tls
        self._offers: dict[str, _Offer] = {}
        self._open = Capabilities()  # the ids of _offers not claimed by a connection yet
        self._listener: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._listener = socket.create_server((self.host, self.port), backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        if self.tls is None:
            self._accepting = asyncio.create_task(self._accept_loop())
        else:
            self._server = await asyncio.start_server(
                self._on_tls_conn,
                sock=self._listener,
                ssl=self.tls,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
            )
        log.info(
            "KV sender listening on %s:%d%s",
            self.host,
            self.port,
            " (mutual TLS)" if self.tls else "",
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
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

    def offer(
        self, purpose: str, meta: bytes, payload: memoryview | bytes, num_tokens: int, ttl_s: float
    ) -> KVHandle:
        # Hashing at offer time (xxh3: ~3 ms for 64 MiB here) pins the checksum to the bytes
        # as offered, so a producer that reuses its buffer too early shows up as a mismatch,
        # not as bad KV.
        view = memoryview(payload).cast("B")
        return self._register(
            purpose, meta, view, xxhash.xxh3_64_intdigest(view), num_tokens, ttl_s
        )

    async def offer_off_loop(
        self, purpose: str, meta: bytes, payload: memoryview | bytes, num_tokens: int, ttl_s: float
    ) -> KVHandle:
        view = memoryview(payload).cast("B")
        checksum = await asyncio.to_thread(xxhash.xxh3_64_intdigest, view)
        return self._register(purpose, meta, view, checksum, num_tokens, ttl_s)

    def _register(
        self,
        purpose: str,
        meta: bytes,
        view: memoryview,
        checksum: int,
        num_tokens: int,
        ttl_s: float,
    ) -> KVHandle:
        transfer_id = new_transfer_id()  # minted here: never the caller's, never guessable
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(
            ttl_s, lambda: asyncio.ensure_future(self._drop(transfer_id, TransferState.FAILED))
        )
        self._offers[transfer_id] = _Offer(meta, view, checksum, expiry)
        self._open.add(transfer_id)
        self.states.label(transfer_id, purpose)
        self.states.set_initial(transfer_id, TransferState.WAITING)
        return KVHandle(
            transfer_id=transfer_id,
            host=self.advertise_host,
            port=self.port,
            nbytes=len(view),
            num_tokens=num_tokens,
        )

    async def withdraw(self, transfer_id: str) -> None:
        await self._drop(transfer_id, TransferState.FAILED)

    async def _drop(self, transfer_id: str, state: TransferState) -> None:
        self._open.discard(transfer_id)
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
                conn, addr = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                log.warning("KV sender cannot accept: %s", exc)
                await asyncio.sleep(0.1)
                continue
            tune_socket(conn)
            task = asyncio.create_task(self._serve_conn(SocketChannel(conn, host_of(addr))))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _on_tls_conn(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """asyncio runs this per connection once the handshake (client certificate
        included) has passed; tracked like the plain ones so close() ends it."""
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve_conn(TlsChannel(reader, writer))
        finally:
            self._conns.discard(task)

    async def _read_request(self, ch: Channel) -> tuple[bytes, bytes]:
        magic, id_len = REQUEST.unpack(await ch.recv_exact(REQUEST.size))
        if magic not in self.MAGICS or id_len > MAX_ID_LEN:
            return magic, b""  # refused without reading what a stranger sends
        return magic, await ch.recv_exact(id_len)

    async def _serve_conn(self, ch: Channel) -> None:
        tid = ""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                magic, presented = await self._read_request(ch)
            tid = self._claim(ch.peer, magic, presented) or ""
            if not tid:
                await ch.sendall(HEADER.pack(MAGIC, STATUS_UNKNOWN, 0, 0, 0))
                return
            await self._serve(ch, magic, tid)
        except (
            TimeoutError,
            OSError,
            asyncio.IncompleteReadError,
            struct.error,
            TransferFailed,
        ) as exc:
            log.warning(
                "KV transfer %s failed on the sender (peer %s): %s",
                short_id(tid) if tid else "?",
                ch.peer,
                str(exc) or type(exc).__name__,
            )
            if tid:
                await self._drop(tid, TransferState.FAILED)
            else:  # a request cut short, silent or unreadable: refused like a bad id
                self.refusals.refused(ch.peer, f"malformed request ({type(exc).__name__})")
        finally:
            ch.close()

    def _claim(self, peer: str, magic: bytes, presented: bytes) -> str | None:
        """The offer's id if `presented` opens one, claimed so that it works only once;
        None (refused, counted) otherwise. No real transfer is touched on a refusal."""
        tid = self._open.claim(presented) if magic in self.MAGICS and presented else None
        if tid is None or tid not in self._offers:
            self.refusals.refused(
                peer,
                "unknown request kind"
                if magic not in self.MAGICS
                else "unknown, used or expired transfer id",
            )
            return None
        self.refusals.accepted(peer)
        return tid

    async def _serve(self, ch: Channel, magic: bytes, tid: str) -> None:
        """One claimed request; subclasses serve their own request kinds by magic."""
        offer = self._offers[tid]
        await self.states.set(tid, TransferState.TRANSFERRING)
        head = HEADER.pack(MAGIC, STATUS_OK, len(offer.meta), len(offer.payload), offer.checksum)
        await ch.sendall(head + offer.meta + bytes(padding(len(offer.meta))))
        for start in range(0, len(offer.payload), CHUNK):
            await ch.sendall(offer.payload[start : start + CHUNK])
        ack = await ch.recv_exact(1)
        await self._drop(tid, TransferState.DONE if ack == b"\x01" else TransferState.FAILED)


class TcpKVReceiver(KVReceiver):
    """Fetches over TCP into a new bytearray, or into what `allocate(nbytes)` returns.

    A fresh 64 MiB bytearray costs ~35 ms of zero-filled page faults here, more than the
    loopback copy itself; a caller that recycles its buffers (and knows when it is done
    with one) can pass an allocator that hands them out (a writable buffer of nbytes).
    With `tls` (a client context with this instance's certificate, see shared.tls) every
    connection is mutual TLS, the sender's certificate checked against `tls_hostname` or
    the handle's host.
    """

    def __init__(
        self,
        allocate: Callable[[int], bytearray | memoryview] = bytearray,
        *,
        tls: ssl.SSLContext | None = None,
        tls_hostname: str = "",
    ) -> None:
        super().__init__()
        self.allocate = allocate
        self.tls, self.tls_hostname = tls, tls_hostname

    async def fetch(
        self, handle: KVHandle, timeout_s: float, purpose: str = HANDOFF
    ) -> tuple[bytes, Payload]:
        tid = handle.transfer_id
        self.states.label(tid, purpose)
        await self.states.set(tid, TransferState.WAITING)
        try:
            async with asyncio.timeout(timeout_s):
                result = await self._fetch(handle)
        except TimeoutError as exc:
            await self.states.set(tid, TransferState.FAILED)
            raise TransferFailed(
                f"transfer {short_id(tid)} timed out after {timeout_s:.1f}s"
            ) from exc
        except (OSError, asyncio.IncompleteReadError, struct.error, TransferFailed) as exc:
            if isinstance(exc, (BadFrame, CutShort)):
                self.bad_frames += 1  # cut short counts too: the sender never finished it
            await self.states.set(tid, TransferState.FAILED)
            raise TransferFailed(
                f"transfer {short_id(tid)} from {handle.host}:{handle.port}: {exc}"
            ) from exc
        await self.states.set(tid, TransferState.DONE)
        return result

    async def open(self, handle: KVHandle) -> Channel:
        return await open_channel(handle.host, handle.port, self.tls, self.tls_hostname)

    async def _fetch(self, handle: KVHandle) -> tuple[bytes, Payload]:
        ch = await self.open(handle)
        try:
            tid = handle.transfer_id.encode()
            await ch.sendall(REQUEST.pack(MAGIC, len(tid)) + tid)
            magic, status, meta_len, payload_len, checksum = HEADER.unpack(
                await ch.recv_exact(HEADER.size)
            )
            if magic != MAGIC:
                raise BadFrame(f"not a KV transfer header (magic {magic!r})")
            if status != STATUS_OK:
                raise TransferFailed("unknown, used or expired transfer id")
            check_sizes(meta_len, payload_len, handle.nbytes)
            await self.states.set(handle.transfer_id, TransferState.TRANSFERRING)
            meta = (await ch.recv_exact(meta_len + padding(meta_len)))[:meta_len]
            payload = self.allocate(payload_len)
            view = memoryview(payload).cast("B")
            if len(view) != payload_len:
                raise TransferFailed(f"allocate({payload_len}) gave {len(view)} bytes")
            hasher = xxhash.xxh3_64()
            await ch.recv_into_exact(view, hasher)
            if hasher.intdigest() != checksum:
                await ch.sendall(b"\x00")
                raise BadFrame("checksum mismatch")
            await ch.sendall(b"\x01")
            return meta, payload
        finally:
            ch.close()
