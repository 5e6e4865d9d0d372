"""The shared-memory data plane: states, cleanup of /dev/shm, failures, and the bench."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest

from shared import tls
from shared.messages import KVHandle
from shared.transfer import TransferFailed, TransferState
from shared.transfer.shm import (
    SHM_DIR,
    ShmKVReceiver,
    ShmKVSender,
    host_id,
    segments,
    unlink_segment,
)
from shared.transfer.tcp import TcpKVReceiver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


def my_segments() -> list[str]:
    """Straight from the directory listing, not through the module under test."""
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"hmkv.{os.getpid()}.")]


@dataclass
class Plane:
    """Senders and receivers of one data-plane set-up: plain, or its control channel (and
    any TCP fallback) over mutual TLS. Shared memory works the same under either."""

    server: Any = None
    client: Any = None

    def sender(self, **kw: Any) -> ShmKVSender:
        return ShmKVSender(tls=self.server, **kw)

    def shm(self, **kw: Any) -> ShmKVReceiver:
        return ShmKVReceiver(tls=self.client, **kw)

    def tcp(self, **kw: Any) -> TcpKVReceiver:
        return TcpKVReceiver(tls=self.client, **kw)


@pytest.fixture(params=["plain", "tls"])
def plane(request) -> Plane:
    if request.param == "plain":
        return Plane()
    pki = request.getfixturevalue("pki")
    return Plane(*tls.kv_contexts(pki.cert, pki.key, pki.ca))


@pytest.fixture
async def sender(plane):
    s = plane.sender()
    await s.start()
    yield s
    await s.close()
    assert my_segments() == []


@pytest.mark.parametrize("copy", [False, True])
async def test_round_trip_and_states(sender, copy, plane):
    payload = os.urandom(9 << 20)
    handle = sender.offer("handoff", b'{"m": 1}', payload, num_tokens=7, ttl_s=10)
    assert handle.transport == "shm" and handle.host_id == host_id() != ""
    assert my_segments() == [handle.shm_name]  # written at offer time
    assert sender.state(handle.transfer_id) == TransferState.WAITING
    receiver = plane.shm(copy=copy)
    meta, got = await receiver.fetch(handle, timeout_s=10)
    assert meta == b'{"m": 1}' and bytes(got) == payload and len(got) == len(payload)
    assert isinstance(got, bytearray if copy else memoryview)
    assert receiver.state(handle.transfer_id) == TransferState.DONE
    assert await sender.wait(handle.transfer_id, 5) == TransferState.DONE
    assert sender.pending == 0 and my_segments() == []
    if not copy:  # the view outlives the segment's name and is ours to write
        got[0] ^= 0xFF
        assert got[0] == payload[0] ^ 0xFF


async def test_an_offer_off_the_loop_writes_its_segment_on_another_thread(
    sender, plane, monkeypatch
):
    """offer_off_loop: the same handle and bytes as offer(), the copy and checksum done on
    a worker thread while the event loop goes on."""
    import threading

    import shared.transfer.shm as shm

    writers: list[int] = []
    real = shm.write_segment

    def spy(view: memoryview) -> tuple[str, int]:
        writers.append(threading.get_ident())
        return real(view)

    monkeypatch.setattr(shm, "write_segment", spy)
    payload = os.urandom(9 << 20)
    handle = await sender.offer_off_loop("handoff", b'{"m": 2}', payload, 7, ttl_s=10)
    assert writers and writers[0] != threading.get_ident()  # not on the loop's thread
    assert handle.transport == "shm" and my_segments() == [handle.shm_name]
    meta, got = await plane.shm().fetch(handle, timeout_s=10)
    assert meta == b'{"m": 2}' and bytes(got) == payload
    assert await sender.wait(handle.transfer_id, 5) == TransferState.DONE
    # A TCP receiver fetches the same offer's bytes too (the sender keeps the payload).
    again = await sender.offer_off_loop("handoff", b"{}", payload, 7, ttl_s=10)
    _, over_tcp = await plane.tcp().fetch(again, timeout_s=10)
    assert bytes(over_tcp) == payload


async def test_segment_written_on_request_when_not_eager(plane):
    sender = plane.sender(eager=False)
    await sender.start()
    try:
        payload = os.urandom(1 << 20)
        handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
        assert handle.transport == "shm" and handle.shm_name == "" and my_segments() == []
        _, got = await plane.shm().fetch(handle, timeout_s=10)
        assert bytes(got) == payload
        assert await sender.wait(handle.transfer_id, 5) == TransferState.DONE
        assert my_segments() == []
    finally:
        await sender.close()


async def test_other_hosts_and_plain_tcp_receivers_get_it_over_tcp(sender, plane):
    payload = os.urandom(3 << 20)
    handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
    elsewhere = handle.model_copy(update={"host_id": "another-host"})
    receiver = plane.shm()
    assert not receiver.same_host(elsewhere)
    _, got = await receiver.fetch(elsewhere, timeout_s=10)
    assert isinstance(got, bytearray) and got == payload  # a view would mean it mapped shm
    assert await sender.wait(handle.transfer_id, 5) == TransferState.DONE
    assert my_segments() == []  # the unused segment went with the offer

    handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
    _, got = await plane.tcp().fetch(handle, timeout_s=10)
    assert got == payload and await sender.wait(handle.transfer_id, 5) == TransferState.DONE


async def test_receivers_fill_the_callers_buffer_when_given_an_allocator(sender, plane):
    payload = os.urandom(2 << 20)
    mine = bytearray(3 << 20)

    def alloc(n):
        return memoryview(mine)[:n]

    handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
    _, got = await plane.tcp(allocate=alloc).fetch(handle, timeout_s=10)
    assert got.obj is mine and mine[: len(payload)] == payload

    mine[:] = bytes(len(mine))
    handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
    _, got = await plane.shm(copy=True, allocate=alloc).fetch(handle, timeout_s=10)
    assert got.obj is mine and mine[: len(payload)] == payload

    handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
    receiver = plane.tcp(allocate=lambda n: bytearray(n + 1))
    with pytest.raises(TransferFailed, match="allocate"):
        await receiver.fetch(handle, timeout_s=10)
    assert await sender.wait(handle.transfer_id, 5) == TransferState.FAILED


async def test_checksum_mismatch_fails_both_sides(sender, plane):
    payload = os.urandom(2 << 20)
    handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
    fd = os.open(os.path.join(SHM_DIR, handle.shm_name), os.O_WRONLY)
    try:
        os.pwrite(fd, bytes([payload[12345] ^ 1]), 12345)  # one flipped bit
    finally:
        os.close(fd)
    receiver = plane.shm()
    with pytest.raises(TransferFailed, match="checksum"):
        await receiver.fetch(handle, timeout_s=10)
    assert receiver.state(handle.transfer_id) == TransferState.FAILED
    assert await sender.wait(handle.transfer_id, 5) == TransferState.FAILED
    assert my_segments() == []


@pytest.mark.parametrize("path", ["tcp", "shm written on request"])
async def test_a_payload_changed_after_offer_is_refused(path, plane):
    """The checksum is taken at offer(): a producer reusing its buffer too early is caught."""
    sender = plane.sender(eager=False)
    await sender.start()
    try:
        payload = bytearray(os.urandom(1 << 20))
        handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=10)
        payload[100] ^= 1
        receiver = plane.tcp() if path == "tcp" else plane.shm()
        with pytest.raises(TransferFailed):
            await receiver.fetch(handle, timeout_s=10)
        assert receiver.state(handle.transfer_id) == TransferState.FAILED
        assert await sender.wait(handle.transfer_id, 5) == TransferState.FAILED
        assert my_segments() == []
    finally:
        await sender.close()


async def test_expiry_unlinks_the_segment(sender, plane):
    handle = sender.offer("handoff", b"{}", b"x" * 4096, 1, ttl_s=0.05)
    assert os.path.exists(os.path.join(SHM_DIR, handle.shm_name))
    assert await sender.wait(handle.transfer_id, 2) == TransferState.FAILED
    assert not os.path.exists(os.path.join(SHM_DIR, handle.shm_name))
    with pytest.raises(TransferFailed):
        await plane.shm().fetch(handle, timeout_s=5)


async def test_close_leaves_no_segment_behind(plane):
    sender = plane.sender()
    await sender.start()
    handles = [sender.offer("handoff", b"{}", os.urandom(1 << 20), 1, ttl_s=60) for _ in range(3)]
    assert len(my_segments()) == 3 and len(segments(os.getpid())) == 3
    await sender.close()
    assert my_segments() == []
    assert all(sender.state(h.transfer_id) == TransferState.FAILED for h in handles)


def test_names_from_the_network_cannot_reach_other_files(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    unlink_segment(f"hmkv.1/../../..{victim}")
    unlink_segment(str(victim))
    assert victim.read_bytes() == b"keep me"


_CHILD = """
import asyncio, sys
from shared.transfer.shm import ShmKVSender
async def main():
    s = ShmKVSender()
    await s.start()
    h = s.offer("handoff", b"{}", b"k" * (4 << 20), 1, ttl_s=60)
    print(h.model_dump_json(), flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


class SenderChild:
    """A ShmKVSender in its own process, offering one transfer, that the test can stop or kill."""

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, cwd=ROOT
        )
        self.handle = KVHandle.model_validate_json(self.proc.stdout.readline())
        self.path = os.path.join(SHM_DIR, self.handle.shm_name)
        assert self.handle.transport == "shm" and os.path.exists(self.path)
        return self

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait(10)
        unlink_segment(self.handle.shm_name)


# Room for a loaded machine's scheduling past a fetch's timeout (a stopped sender never
# answers, so nothing else could end that fetch).
SLACK_S = 5.0


async def test_stalled_then_killed_sender_fails_the_fetch_and_its_segment_goes():
    with SenderChild() as child:
        child.signal(signal.SIGSTOP)  # alive but silent: only the timeout can end it
        receiver = ShmKVReceiver()
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="timed out"):
            await receiver.fetch(child.handle, timeout_s=0.5)
        assert time.monotonic() - t0 < 0.5 + SLACK_S
        assert receiver.state(child.handle.transfer_id) == TransferState.FAILED
        assert os.path.exists(child.path)  # a stalled sender may come back: not ours to remove

        connected = asyncio.Event()
        open_channel = receiver.open

        async def opened(handle):  # type: ignore[no-untyped-def]
            ch = await open_channel(handle)
            connected.set()
            return ch

        receiver.open = opened  # type: ignore[method-assign]
        timeout_s = 120.0
        fetching = asyncio.create_task(receiver.fetch(child.handle, timeout_s=timeout_s))
        await asyncio.wait_for(connected.wait(), 30)  # the kernel accepted it: it waits
        assert not fetching.done()
        t0 = time.monotonic()
        child.signal(signal.SIGKILL)
        with pytest.raises(TransferFailed):
            await fetching
        # The broken connection ends it, not the timeout.
        assert time.monotonic() - t0 < timeout_s / 4
        assert receiver.state(child.handle.transfer_id) == TransferState.FAILED
        assert not os.path.exists(child.path)  # the dead sender's segment did not leak


async def test_fetch_from_a_dead_sender_fails_fast_and_removes_its_segment():
    with SenderChild() as child:
        child.signal(signal.SIGKILL)
        child.proc.wait(10)
        assert os.path.exists(child.path)  # SIGKILL gave the sender no chance to clean up
        receiver = ShmKVReceiver()
        t0 = time.monotonic()
        timeout_s = 120.0
        with pytest.raises(TransferFailed):
            await receiver.fetch(child.handle, timeout_s=timeout_s)
        assert time.monotonic() - t0 < timeout_s / 4  # refused at once, not timed out
        assert receiver.state(child.handle.transfer_id) == TransferState.FAILED
        assert not os.path.exists(child.path)


def test_bench_quick_mode_prints_the_figures():
    proc = subprocess.run(
        [sys.executable, "-m", "services.tools.bench.transfer_bench"]
        + ["--mib", "4", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["mib"] == 4 and doc["rounds"] == 1
    assert set(doc["results"]) == {"plain", "plain_reused", "tcp", "tcp_reused", "shm", "shm_copy"}
    for mode, r in doc["results"].items():
        assert r["fetch_mib_s"]["best"] > 0 and r["fetch_ms"]["median"] > 0, mode
    assert doc["results"]["shm"]["offer_ms"]["best"] > 0  # the segment write is reported
    assert doc["ratios"]["tcp_over_plain"]["target"] == 0.7
    assert doc["ratios"]["shm_over_tcp"]["target"] == 2.0
    assert set(doc["included"]) >= {"plain", "tcp", "shm"}
    assert doc["leftover_shm_segments"] == []
    assert "tcp_over_plain" in proc.stderr and "MiB/s" in proc.stderr
