"""Who may pull KV bytes: transfer ids are single-use 128-bit capabilities, unknown ones
are refused (counted, and a run from one peer logged) without touching a real transfer,
and with TLS on only holders of a cluster certificate get through. Real loopback
sockets, a real sender; the guesser is a plain socket client."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import ssl

import pytest
from pydantic import ValidationError

from services.prefill.args import PrefillSettings
from shared import tls
from shared.transfer import TransferFailed, TransferState, base, tcp
from shared.transfer.base import Capabilities, Refusals, new_transfer_id
from shared.transfer.channel import connect
from shared.transfer.fake import FakeKVSender
from shared.transfer.frames import HEADER, MAGIC, REQUEST, STATUS_UNKNOWN
from shared.transfer.shm import SHM_DIR, SHM_MAGIC, ShmKVReceiver, ShmKVSender, host_id
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender

REFUSED = HEADER.pack(MAGIC, STATUS_UNKNOWN, 0, 0, 0)
HAS_SHM = os.path.isdir(SHM_DIR) and bool(host_id())


def my_segments() -> list[str]:
    if not os.path.isdir(SHM_DIR):
        return []
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"hmkv.{os.getpid()}.")]


async def ask(port: int, magic: bytes, transfer_id: bytes) -> bytes:
    """One request the way a stranger would send it; everything the sender answers."""
    loop = asyncio.get_running_loop()
    sock = await connect("127.0.0.1", port)
    try:
        await loop.sock_sendall(sock, REQUEST.pack(magic, len(transfer_id)) + transfer_id)
        reply = b""
        try:
            while chunk := await loop.sock_recv(sock, 65536):
                reply += chunk
        except ConnectionResetError:  # refused without reading all we sent: the kernel resets
            pass
        return reply
    finally:
        sock.close()


def test_transfer_ids_are_fresh_128_bit_capabilities():
    sender = FakeKVSender()
    ids = {sender.offer("handoff", b"{}", b"x", 1, ttl_s=1).transfer_id for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in ids)  # 16 random bytes, in hex
    assert base.short_id(next(iter(ids))) == next(iter(ids))[:8]


async def test_10000_random_ids_are_refused_and_cost_no_transfer(caplog):
    """Both request kinds (TCP, and shared memory where there is /dev/shm) against one live
    sender holding a real offer: every guess gets the bare refusal header, nothing moves."""
    sender = ShmKVSender(eager=False) if HAS_SHM else TcpKVSender()
    await sender.start()
    changes: list[tuple[str, TransferState]] = []
    real_set = sender.states.set

    async def spy(transfer_id: str, state: TransferState) -> None:
        changes.append((transfer_id, state))
        await real_set(transfer_id, state)

    sender.states.set = spy  # type: ignore[method-assign]
    try:
        payload = os.urandom(1 << 20)
        real = sender.offer("handoff", b"{}", payload, 1, ttl_s=600)
        magics = [MAGIC, SHM_MAGIC] if HAS_SHM else [MAGIC]
        gate = asyncio.Semaphore(16)

        async def guess(i: int) -> bytes:
            async with gate:
                return await ask(
                    sender.port, magics[i % len(magics)], secrets.token_hex(16).encode()
                )

        with caplog.at_level(logging.WARNING, logger="shared.transfer.base"):
            replies = await asyncio.gather(*(guess(i) for i in range(10_000)))
        assert set(replies) == {REFUSED}  # a header and no byte of anyone's KV
        assert sender.refusals.total == 10_000
        assert changes == []  # no transfer started, failed or was dropped
        assert sender.state(real.transfer_id) == TransferState.WAITING and sender.pending == 1
        assert my_segments() == []  # a guess never made the sender write a segment
        runs = [r.getMessage() for r in caplog.records if "refused requests in a row" in r.message]
        assert len(runs) == 4 and all("127.0.0.1" in m for m in runs)  # 10, 100, 1,000, 10,000
        _, got = await TcpKVReceiver().fetch(real, timeout_s=10)  # the real one still works
        assert got == payload
        assert sender.refusals.run_of("127.0.0.1") == 0  # a success ends the run
    finally:
        await sender.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_valid_id_works_once_and_only_once(transport):
    if transport == "shm" and not HAS_SHM:
        pytest.skip("needs /dev/shm")
    sender = ShmKVSender() if transport == "shm" else TcpKVSender()
    receiver = ShmKVReceiver() if transport == "shm" else TcpKVReceiver()
    await sender.start()
    try:
        payload = os.urandom(1 << 20)
        handle = sender.offer("handoff", b"{}", payload, 1, ttl_s=60)
        _, got = await receiver.fetch(handle, timeout_s=10)
        assert bytes(got) == payload
        with pytest.raises(TransferFailed, match="unknown, used or expired"):
            await receiver.fetch(handle, timeout_s=10)
        assert sender.refusals.total == 1

        # Two receivers at once with one id: the first to present it claims it.
        big = os.urandom(32 << 20)
        handle = sender.offer("handoff", b"{}", big, 1, ttl_s=60)
        results = await asyncio.gather(
            receiver.fetch(handle, timeout_s=30),
            TcpKVReceiver().fetch(handle, timeout_s=30),
            return_exceptions=True,
        )
        assert sorted(type(r).__name__ for r in results) == ["TransferFailed", "tuple"]
        assert bytes(next(r for r in results if isinstance(r, tuple))[1]) == big
        assert await sender.wait(handle.transfer_id, 5) == TransferState.DONE
        assert sender.refusals.total == 2 and my_segments() == []
    finally:
        await sender.close()


async def test_a_withdrawn_id_is_refused_like_an_unknown_one():
    sender = TcpKVSender()
    await sender.start()
    try:
        handle = sender.offer("prefix", b"{}", b"k" * 4096, 1, ttl_s=60)
        await sender.withdraw(handle.transfer_id)
        assert await ask(sender.port, MAGIC, handle.transfer_id.encode()) == REFUSED
        assert sender.refusals.total == 1
    finally:
        await sender.close()


async def test_malformed_requests_are_refused_unread():
    sender = TcpKVSender()
    await sender.start()
    try:
        # Left unread, the rest of a request may reset the connection before the refusal
        # header arrives: either way, nothing else comes back.
        assert await ask(sender.port, b"EVIL", secrets.token_hex(16).encode()) in (REFUSED, b"")
        assert await ask(sender.port, MAGIC, b"a" * 5000) in (REFUSED, b"")  # longer than any id
        assert await ask(sender.port, MAGIC, b"") == REFUSED
        assert sender.refusals.total == 3
    finally:
        await sender.close()


async def test_a_silent_peer_is_dropped(monkeypatch):
    monkeypatch.setattr(tcp, "REQUEST_TIMEOUT_S", 0.2)
    sender = TcpKVSender()
    await sender.start()
    loop = asyncio.get_running_loop()
    sock = await connect("127.0.0.1", sender.port)
    try:
        t0 = loop.time()
        assert await asyncio.wait_for(loop.sock_recv(sock, 100), 5) == b""  # closed on us
        assert loop.time() - t0 < 3
    finally:
        sock.close()
        await sender.close()


def test_capabilities_match_the_whole_id_in_constant_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = base.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(base.hmac, "compare_digest", spy)
    caps = Capabilities()
    tid = new_transfer_id()
    caps.add(tid)
    for wrong in (tid[:-1], tid + "0", tid.upper(), "", new_transfer_id()):
        assert caps.claim(wrong.encode()) is None
    assert caps.claim(tid.encode()) == tid
    assert calls and calls[-1] == (tid.encode(), tid.encode())
    assert caps.claim(tid.encode()) is None and len(caps) == 0  # claimed: once only


def test_refusal_runs_are_logged_per_peer_and_a_success_ends_one(caplog):
    refusals = Refusals()
    with caplog.at_level(logging.WARNING, logger="shared.transfer.base"):
        for _ in range(9):
            refusals.refused("10.0.0.7")
        refusals.refused("10.0.0.8")  # another peer's run is its own
        assert caplog.records == []
        refusals.refused("10.0.0.7")
        assert len(caplog.records) == 1 and "10.0.0.7" in caplog.records[0].getMessage()
        refusals.accepted("10.0.0.7")
        for _ in range(9):
            refusals.refused("10.0.0.7")
        assert len(caplog.records) == 1
    assert refusals.total == 20


# -- mutual TLS -------------------------------------------------------------------------
def _client(ca: str, cert: str, key: str) -> ssl.SSLContext:
    return tls.client_context(ca, cert, key, prefix="kv_tls")


async def test_tls_lets_only_cluster_certificates_through(pki):
    server, client = tls.kv_contexts(pki.cert, pki.key, pki.ca)
    sender = TcpKVSender(tls=server)
    await sender.start()
    try:
        handle = sender.offer("handoff", b"{}", os.urandom(1 << 16), 1, ttl_s=60)
        strangers = {
            "plain TCP": TcpKVReceiver(),
            "no certificate": TcpKVReceiver(tls=tls.client_context(pki.ca, prefix="kv_tls")),
            "another CA's certificate": TcpKVReceiver(
                tls=_client(pki.ca, pki.rogue_cert, pki.rogue_key)
            ),
            "trusting another CA": TcpKVReceiver(tls=_client(pki.rogue_ca, pki.cert, pki.key)),
            "the wrong name": TcpKVReceiver(tls=client, tls_hostname="prefill-9"),
        }
        for who, receiver in strangers.items():
            with pytest.raises(TransferFailed):
                await receiver.fetch(handle, timeout_s=10)
            assert sender.state(handle.transfer_id) == TransferState.WAITING, who
        _, got = await TcpKVReceiver(tls=client, tls_hostname="localhost").fetch(handle, 10)
        assert len(got) == 1 << 16
    finally:
        await sender.close()


def test_data_plane_tls_settings_are_all_or_nothing(pki, tmp_path):
    ok = PrefillSettings(kv_tls_cert=pki.cert, kv_tls_key=pki.key, kv_tls_ca=pki.ca)
    assert ok.kv_tls_cert == pki.cert
    with pytest.raises(ValidationError, match="go together"):
        PrefillSettings(kv_tls_cert=pki.cert, kv_tls_key=pki.key)
    with pytest.raises(ValidationError, match="kv_tls_ca: no such file"):
        PrefillSettings(kv_tls_cert=pki.cert, kv_tls_key=pki.key, kv_tls_ca=str(tmp_path / "x"))
    with pytest.raises(ValidationError, match="cannot load certificate"):
        PrefillSettings(kv_tls_cert=pki.ca, kv_tls_key=pki.key, kv_tls_ca=pki.ca)  # key mismatch


async def test_engines_build_their_data_plane_from_the_settings(pki):
    from services.worker.settings import make_receiver, make_sender

    settings = PrefillSettings(
        kv_tls_cert=pki.cert,
        kv_tls_key=pki.key,
        kv_tls_ca=pki.ca,
        kv_tls_hostname="localhost",
        kv_transport="tcp",
    )
    sender, receiver = make_sender(settings), make_receiver(settings)
    assert sender.tls is not None and receiver.tls is not None  # type: ignore[attr-defined]
    await sender.start()
    try:
        handle = sender.offer("handoff", b"{}", b"kv" * 1000, 1, ttl_s=60)
        _, got = await receiver.fetch(handle, timeout_s=10)
        assert bytes(got) == b"kv" * 1000
    finally:
        await sender.close()
    plain = PrefillSettings()
    assert make_sender(plain).tls is None  # type: ignore[attr-defined]
