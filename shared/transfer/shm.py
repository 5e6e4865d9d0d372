"""KV transfer through shared memory when sender and receiver share a host.

The sender writes the payload into a file under /dev/shm (a tmpfs segment) and the
receiver maps it, so the bytes never cross the loopback stack (two kernel copies and a
wake-up per socket buffer). The sender's TCP server stays the control channel: it tells
the receiver the segment's name, size and checksum, and learns when it may unlink it.

    receiver → sender   SHM_MAGIC | u16 id_len | transfer id
    sender → receiver   MAGIC | u8 status | u32 meta_len | u64 payload_len | u64 xxh3 | meta
                        | u16 name_len | name
    receiver → sender   u8 ack (1: verified)

A ShmKVSender is also a full TcpKVSender, and a ShmKVReceiver falls back to TCP when the
handle's host_id is not its own, so one pair serves same-host and remote peers alike.
The capability rules are TCP's: the request presents the single-use transfer id, and only
a claimed one makes the sender write (or name) a segment. With TLS on, this control
channel is mutual TLS too; the segment itself is a 0600 file of this user's.

Who removes a segment: the sender, on ack, expiry, failure or close(); the receiver too,
right after it has mapped and verified it, and when the sender is evidently gone
(connection refused, reset or closed mid-way), since a dead sender cannot. Unlinking only
removes the name: a mapping made before stays valid, so the receiver's view outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import os
import re
import secrets
import socket
import ssl
import struct
from typing import Callable

import xxhash

from shared.messages import KVHandle
from shared.transfer.base import BadFrame, Payload, TransferFailed, TransferState, short_id
from shared.transfer.channel import Channel
from shared.transfer.frames import HEADER, MAGIC, REQUEST, STATUS_OK, check_sizes
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_MAGIC = b"HMSH"
PREFIX = "hmkv."
# Names come from the network; anything else is never opened or unlinked.
_NAME_RE = re.compile(r"hmkv\.[0-9]+\.[0-9a-f]{12}")
_U16 = struct.Struct("<H")
_WRITE_STEP = 1 << 20  # fits in L2, so the hash pulls each piece in for the write


@functools.cache
def host_id() -> str:
    """Equal for two processes exactly when they see the same /dev/shm and network ("" if
    there is no /dev/shm)."""
    try:
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    # Containers on one kernel share the boot id but may each mount their own /dev/shm;
    # the tmpfs's device and inode tell those apart. Processes in different network
    # namespaces are on different hosts as far as their peers know (the multi-host harness
    # makes hosts that way): they talk TCP, as machines would.
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    return f"{boot}:{st.st_dev}:{st.st_ino}:{net}"


def segments(pid: int | None = None) -> list[str]:
    """Names of this transport's segments now in /dev/shm (one process's, or all)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    want = f"{PREFIX}{pid}." if pid is not None else PREFIX
    return sorted(n for n in names if n.startswith(want) and _NAME_RE.fullmatch(n))


def _path(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise TransferFailed(f"not a KV segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def write_segment(payload: memoryview) -> tuple[str, int]:
    """A new segment holding `payload`: its name and the payload's xxh3.

    pwrite rather than writing through a mapping: tmpfs fills pages on the write path
    without a page fault per 4 KiB, about 1.5x faster here for fresh segments. Hashing each
    piece just before writing it reads the payload from memory once instead of twice.
    """
    name = f"{PREFIX}{os.getpid()}.{secrets.token_hex(6)}"
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    hasher = xxhash.xxh3_64()
    try:
        for start in range(0, len(payload), _WRITE_STEP):
            piece = payload[start : start + _WRITE_STEP]
            hasher.update(piece)
            done = 0
            while done < len(piece):
                done += os.pwrite(fd, piece[done:], start + done)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)
    return name, hasher.intdigest()


def unlink_segment(name: str) -> None:
    if name and _NAME_RE.fullmatch(name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


def map_segment(
    name: str,
    nbytes: int,
    checksum: int,
    into: Callable[[int], Payload] | None = None,
) -> Payload | None:
    """The segment's first nbytes, verified (None on a checksum mismatch).

    Without `into`, a view of a mapping that lives as long as the view does; with it, a
    copy in into(nbytes), and the mapping is gone on return.
    """
    fd = os.open(_path(name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise TransferFailed(f"segment {name} is shorter than {nbytes} bytes")
        if nbytes == 0:  # mmap refuses empty mappings
            return bytearray() if checksum == xxhash.xxh3_64_intdigest(b"") else None
        # No MAP_POPULATE: it faults every page in for writing (map 7.4 + hash 3.2 ms for
        # 64 MiB here); letting the hash fault them in for reading, 16 pages at a time, 8.3 ms.
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if xxhash.xxh3_64_intdigest(mm) != checksum:
        mm.close()
        return None
    if into is None:
        return memoryview(mm)
    out: Payload
    if into is bytearray:
        out = bytearray(mm)  # one pass; bytearray(n) would zero-fill every page first
    else:
        out = into(nbytes)
        memoryview(out).cast("B")[:] = mm
    mm.close()
    return out


class ShmKVSender(TcpKVSender):
    """A TCP sender that also hands same-host receivers a shared-memory segment.

    eager=True writes the segment in offer() (the caller waits for the copy: ~35 ms per
    64 MiB of fresh tmpfs pages here), so a same-host fetch is only map + verify + ack;
    eager=False writes it when a same-host receiver asks, which spares the copy and the
    tmpfs memory when most receivers are remote. Either way the offer also keeps the
    payload itself, so a remote receiver (or a plain TcpKVReceiver) can fetch it over TCP.
    """

    MAGICS = TcpKVSender.MAGICS | {SHM_MAGIC}

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str = "",
        eager: bool = True,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(host, port, advertise_host, tls=tls)
        self.eager = eager
        self._segments: dict[str, str] = {}

    def offer(
        self, purpose: str, meta: bytes, payload: memoryview | bytes, num_tokens: int, ttl_s: float
    ) -> KVHandle:
        view = memoryview(payload).cast("B")
        written = self._write(purpose, view) if self._writes_at_offer() else None
        if written is not None:
            return self._offer_segment(purpose, meta, view, written, num_tokens, ttl_s)
        return self._without_segment(super().offer(purpose, meta, view, num_tokens, ttl_s))

    async def offer_off_loop(
        self, purpose: str, meta: bytes, payload: memoryview | bytes, num_tokens: int, ttl_s: float
    ) -> KVHandle:
        view = memoryview(payload).cast("B")
        written = (
            await asyncio.to_thread(self._write, purpose, view) if self._writes_at_offer() else None
        )
        if written is not None:
            return self._offer_segment(purpose, meta, view, written, num_tokens, ttl_s)
        handle = await super().offer_off_loop(purpose, meta, view, num_tokens, ttl_s)
        return self._without_segment(handle)

    def _writes_at_offer(self) -> bool:
        return self.eager and bool(host_id())

    def _without_segment(self, handle: KVHandle) -> KVHandle:
        """A TCP offer's handle, marked for shared memory when the segment is written on a
        same-host receiver's request (eager=False). Plain TCP with no /dev/shm here, or
        when it was full at offer time."""
        return self._as_shm(handle, "") if host_id() and not self.eager else handle

    @staticmethod
    def _write(purpose: str, view: memoryview) -> tuple[str, int] | None:
        """A segment with the payload (its name and checksum); None if /dev/shm is full,
        and the transfer goes over TCP. Touches no sender state: any thread may run it."""
        try:
            return write_segment(view)
        except OSError as exc:
            log.warning("no shared-memory segment for a %s offer: %s", purpose, exc)
            return None

    def _offer_segment(
        self,
        purpose: str,
        meta: bytes,
        view: memoryview,
        written: tuple[str, int],
        num_tokens: int,
        ttl_s: float,
    ) -> KVHandle:
        name, checksum = written
        handle = self._register(purpose, meta, view, checksum, num_tokens, ttl_s)
        self._segments[handle.transfer_id] = name
        return self._as_shm(handle, name)

    @staticmethod
    def _as_shm(handle: KVHandle, name: str) -> KVHandle:
        """A handle a same-host receiver maps."""
        return handle.model_copy(
            update={"transport": "shm", "shm_name": name, "host_id": host_id()}
        )

    def _segment_for(self, transfer_id: str) -> str:
        name = self._segments.get(transfer_id)
        if name is None:
            offer = self._offers[transfer_id]
            name, checksum = write_segment(offer.payload)
            self._segments[transfer_id] = name  # _drop removes it, whatever happens next
            if checksum != offer.checksum:
                raise TransferFailed(
                    f"the payload of {short_id(transfer_id)} changed after offer()"
                )
        return name

    async def _drop(self, transfer_id: str, state: TransferState) -> None:
        unlink_segment(self._segments.pop(transfer_id, ""))
        await super()._drop(transfer_id, state)

    async def close(self) -> None:
        await super().close()
        for tid in list(self._segments):  # segments whose offer is gone already
            unlink_segment(self._segments.pop(tid))

    async def _serve(self, ch: Channel, magic: bytes, tid: str) -> None:
        if magic != SHM_MAGIC:
            return await super()._serve(ch, magic, tid)
        offer = self._offers[tid]
        await self.states.set(tid, TransferState.TRANSFERRING)
        name = self._segment_for(tid).encode()
        head = HEADER.pack(MAGIC, STATUS_OK, len(offer.meta), len(offer.payload), offer.checksum)
        await ch.sendall(head + offer.meta + _U16.pack(len(name)) + name)
        ack = await ch.recv_exact(1)
        await self._drop(tid, TransferState.DONE if ack == b"\x01" else TransferState.FAILED)


class ShmKVReceiver(TcpKVReceiver):
    """Maps the sender's segment when it is on this host; fetches over TCP otherwise.

    copy=False (the default) returns the payload as a writable memoryview of a mapping
    this receiver alone holds (no second 64 MiB copy, no fresh pages to fault in); it
    works wherever a bytearray is only read or wrapped (torch.frombuffer, bytes(), slices).
    copy=True copies it into allocate(nbytes) (a new bytearray by default), as TCP does.
    """

    def __init__(
        self,
        copy: bool = False,
        allocate: Callable[[int], bytearray | memoryview] = bytearray,
        *,
        tls: ssl.SSLContext | None = None,
        tls_hostname: str = "",
    ) -> None:
        super().__init__(allocate, tls=tls, tls_hostname=tls_hostname)
        self.copy = copy

    def same_host(self, handle: KVHandle) -> bool:
        return handle.transport == "shm" and bool(handle.host_id) and handle.host_id == host_id()

    async def _fetch(self, handle: KVHandle) -> tuple[bytes, Payload]:
        if not self.same_host(handle):
            return await super()._fetch(handle)
        try:
            ch = await self.open(handle)
        except ConnectionRefusedError:
            unlink_segment(handle.shm_name)  # nobody serves this offer any more
            raise
        try:
            return await self._fetch_shm(ch, handle)
        except (ConnectionError, asyncio.IncompleteReadError):
            # The sender died or dropped us mid-way. (A segment written on request is not
            # named in the handle; if we never learned its name, it is the sender's to remove.)
            unlink_segment(handle.shm_name)
            raise
        finally:
            ch.close()

    async def _fetch_shm(self, ch: Channel, handle: KVHandle) -> tuple[bytes, Payload]:
        tid = handle.transfer_id.encode()
        await ch.sendall(REQUEST.pack(SHM_MAGIC, len(tid)) + tid)
        magic, status, meta_len, nbytes, checksum = HEADER.unpack(await ch.recv_exact(HEADER.size))
        if magic != MAGIC:
            raise BadFrame(f"not a KV transfer header (magic {magic!r})")
        if status != STATUS_OK:
            raise TransferFailed("unknown, used or expired transfer id")
        check_sizes(meta_len, nbytes, handle.nbytes)
        await self.states.set(handle.transfer_id, TransferState.TRANSFERRING)
        meta = await ch.recv_exact(meta_len)
        (name_len,) = _U16.unpack(await ch.recv_exact(_U16.size))
        name = (await ch.recv_exact(name_len)).decode("ascii", "replace")  # checked in map
        payload = map_segment(name, nbytes, checksum, self.allocate if self.copy else None)
        if payload is None:
            await ch.sendall(b"\x00")
            raise BadFrame("checksum mismatch")
        unlink_segment(name)  # mapped (or copied): the name is no longer needed by anyone
        await ch.sendall(b"\x01")
        return meta, payload
