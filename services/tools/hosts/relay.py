"""A TCP relay from the bridge address to a server that listens on loopback only.

PostgreSQL on a development machine usually listens on 127.0.0.1, which the hosts (other
network namespaces) cannot reach. The harness relays one port of the bridge address to it,
so the hosts use the machine's database as they would a database server on the network.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def loopback_port(url: str) -> int:
    """The port of a database URL whose server is on loopback (0: it is not, or no server)."""
    parts = urlsplit(url)
    if parts.hostname not in LOOPBACK:
        return 0
    return parts.port or 5432


def via(url: str, host: str, port: int) -> str:
    """`url` with its server at host:port (user and password kept)."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


class Relay:
    def __init__(self, listen_host: str, target_port: int) -> None:
        self.listen_host = listen_host
        self.target_port = target_port
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, self.listen_host, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            # Open connections are closed by their clients' exit; do not wait on them.
            self.server = None
