"""The control plane with NATS credentials and TLS: a real nats-server (from the wheel)
that requires TLS, a client certificate from the cluster CA, and a user/password; the
services' own connect (shared.bus) gets in, and whoever lacks any one of them does not."""

from __future__ import annotations

import asyncio
import importlib.util
import secrets

import nats
import pytest
from pydantic import ValidationError

from shared import bus
from shared.natsd import EmbeddedNats
from shared.settings import BaseSettings

pytestmark = pytest.mark.timeout(120)
PASSWORD = secrets.token_hex(12)


@pytest.fixture(scope="module")
def secure_nats(tmp_path_factory, pki):
    server = EmbeddedNats(
        tmp_path_factory.mktemp("secure-nats"),
        tls_cert=pki.cert,
        tls_key=pki.key,
        tls_ca=pki.ca,
        user="halfmoon",
        password=PASSWORD,
    )
    url = server.start()
    yield url
    server.stop()


def settings(url: str, pki, **overrides) -> BaseSettings:  # type: ignore[no-untyped-def]
    values = dict(
        nats_url=url,
        nats_user="halfmoon",
        nats_password=PASSWORD,
        nats_tls_ca=pki.ca,
        nats_tls_cert=pki.cert,
        nats_tls_key=pki.key,
    )
    values.update(overrides)
    return BaseSettings(**values)


async def test_services_connect_with_credentials_and_tls(secure_nats, pki):
    assert secure_nats.startswith("tls://127.0.0.1:")
    nc = await bus.connect(settings(secure_nats, pki), "secure-test")
    try:

        async def echo(msg) -> None:  # type: ignore[no-untyped-def]
            await msg.respond(msg.data[::-1])

        await nc.subscribe("halfmoon.test.echo", cb=echo)
        reply = await nc.request("halfmoon.test.echo", b"kv handle", timeout=5)
        assert reply.data == b"eldnah vk"
    finally:
        await bus.close(nc)


@pytest.mark.parametrize("missing", ["password", "client certificate", "CA", "TLS"])
async def test_the_server_turns_away_who_lacks_one_of_them(secure_nats, pki, missing):
    s = {
        "password": settings(secure_nats, pki, nats_password="guess"),
        "client certificate": settings(secure_nats, pki, nats_tls_cert="", nats_tls_key=""),
        "CA": settings(secure_nats, pki, nats_tls_ca=""),  # the system's CAs: not ours
        "TLS": settings(
            secure_nats.replace("tls://", "nats://"),
            pki,
            nats_tls_ca="",
            nats_tls_cert="",
            nats_tls_key="",
        ),
    }[missing]
    with pytest.raises(Exception):  # noqa: B017 - nats-py raises auth, TLS or connect errors
        nc = await asyncio.wait_for(
            nats.connect(
                s.nats_url, allow_reconnect=False, connect_timeout=3, **bus.security_options(s)
            ),
            15,
        )
        await nc.close()


def test_security_settings_fail_at_start_with_the_setting_named(pki, tmp_path):
    with pytest.raises(ValidationError, match="nats_tls_ca: no such file"):
        BaseSettings(nats_tls_ca=str(tmp_path / "nope.pem"))
    with pytest.raises(ValidationError, match="nats_tls_key is set without nats_tls_cert"):
        BaseSettings(nats_tls_key=pki.key)
    plain = bus.security_options(BaseSettings())
    assert plain == {}  # one host, nothing configured: a plain anonymous connection
    assert "tls" in bus.security_options(BaseSettings(nats_url="tls://nats-1:4222"))
    named = bus.security_options(BaseSettings(nats_tls_ca=pki.ca, nats_tls_hostname="nats"))
    assert named["tls_hostname"] == "nats"


@pytest.mark.skipif(importlib.util.find_spec("nkeys") is not None, reason="nkeys is installed")
def test_a_credentials_file_without_nkeys_says_what_to_install(tmp_path):
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n...\n")
    with pytest.raises(ValueError, match="pip install nkeys"):
        bus.security_options(BaseSettings(nats_creds=str(creds)))
