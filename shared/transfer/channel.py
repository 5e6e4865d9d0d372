"""One data-plane connection, plain or TLS: the frames (frames.py) are the same over either.

Plain TCP drives non-blocking sockets with the loop's sock_* calls rather than streams:
streams copy every byte twice more on the receive side (into the reader's buffer, then
out of it) and, on 3.11, re-buffer and memmove unsent data on the send side. Here the
payload goes from the sender's buffer straight into the kernel, and from the kernel
straight into the receiver's final bytearray. With TLS (an ssl.SSLContext on each end)
the bytes must be encrypted anyway, so that path uses asyncio's TLS streams.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import ssl
from typing import Any, Protocol

from shared.tls import HANDSHAKE_TIMEOUT_S
from shared.transfer.frames import CHUNK


class Hasher(Protocol):
    """A running checksum (xxhash's xxh3_64)."""

    def update(self, data: bytes | memoryview, /) -> None: ...


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay on the small control messages.

    Socket buffer sizes are left to the kernel: fixed 4 MiB buffers made no difference on
    loopback here, and setting SO_RCVBUF turns off autotuning (up to tcp_rmem's 32 MiB),
    which a long cross-host link needs.
    """
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class CutShort(ConnectionError):
    """The peer closed the connection before the frame it announced was complete."""


async def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    await recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


async def recv_into_exact(
    sock: socket.socket, view: memoryview, hasher: Hasher | None = None
) -> None:
    """Fill `view` from the socket; feed each piece to `hasher` while it is cache-hot."""
    loop = asyncio.get_running_loop()
    got, total = 0, len(view)
    while got < total:
        n = await loop.sock_recv_into(sock, view[got : got + CHUNK])
        if n == 0:
            raise CutShort(f"connection closed after {got} of {total} bytes")
        if hasher is not None:
            hasher.update(view[got : got + n])
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


def host_of(peername: Any) -> str:
    """The peer's address without its port: the port is new on every connection."""
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return str(peername or "?")


class Channel(abc.ABC):
    """One data-plane connection, plain or TLS: the frames are the same over either."""

    peer: str = "?"

    @abc.abstractmethod
    async def recv_exact(self, nbytes: int) -> bytes: ...

    @abc.abstractmethod
    async def recv_into_exact(self, view: memoryview, hasher: Hasher | None = None) -> None: ...

    @abc.abstractmethod
    async def sendall(self, data: bytes | memoryview) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class SocketChannel(Channel):
    """A plain non-blocking socket: the zero-copy path (see the module doc)."""

    def __init__(self, sock: socket.socket, peer: str = "?") -> None:
        self.sock, self.peer = sock, peer

    async def recv_exact(self, nbytes: int) -> bytes:
        return await recv_exact(self.sock, nbytes)

    async def recv_into_exact(self, view: memoryview, hasher: Hasher | None = None) -> None:
        await recv_into_exact(self.sock, view, hasher)

    async def sendall(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    def close(self) -> None:
        self.sock.close()


class TlsChannel(Channel):
    """asyncio's TLS streams: the handshake (and certificate checks) happened on open."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.peer = host_of(writer.get_extra_info("peername"))

    async def recv_exact(self, nbytes: int) -> bytes:
        try:
            return await self.reader.readexactly(nbytes)
        except asyncio.IncompleteReadError as exc:
            raise CutShort(
                f"connection closed after {len(exc.partial)} of {nbytes} bytes"
            ) from None

    async def recv_into_exact(self, view: memoryview, hasher: Hasher | None = None) -> None:
        got, total = 0, len(view)
        while got < total:
            piece = await self.reader.read(min(CHUNK, total - got))
            if not piece:
                raise CutShort(f"connection closed after {got} of {total} bytes")
            view[got : got + len(piece)] = piece
            if hasher is not None:
                hasher.update(piece)
            got += len(piece)

    async def sendall(self, data: bytes | memoryview) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


async def open_channel(
    host: str, port: int, tls: ssl.SSLContext | None = None, tls_hostname: str = ""
) -> Channel:
    """A connection to a sender; with `tls`, its certificate is checked against
    `tls_hostname` (or `host`) and ours is presented."""
    if tls is None:
        return SocketChannel(await connect(host, port), host)
    reader, writer = await asyncio.open_connection(
        host,
        port,
        ssl=tls,
        server_hostname=tls_hostname or host,
        ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
    )
    return TlsChannel(reader, writer)
