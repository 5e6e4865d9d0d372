"""TLS contexts from settings: for NATS clients and for the KV data plane.

Only the standard library's `ssl`. Every loading error names the setting and the file, so
a wrong path fails at start with a clear message instead of a handshake error later.

The data plane is mutual TLS or nothing: a sender that only encrypted would still hand
KV bytes (a client's prompt, in effect) to anyone who can connect and present a stolen or
leaked transfer id, so it also insists that the receiver holds a certificate from the
cluster's CA. Each engine is both a sender and a receiver (prefill pulls prefixes), so
one certificate serves both ends: it must allow server and client authentication.
"""

from __future__ import annotations

import ssl
from pathlib import Path

HANDSHAKE_TIMEOUT_S = 10.0  # a peer that connects and says nothing gives up its slot


def _check_file(setting: str, path: str) -> None:
    if not Path(path).is_file():
        raise ValueError(f"{setting}: no such file: {path}")


def _load_chain(ctx: ssl.SSLContext, setting: str, cert: str, key: str) -> None:
    _check_file(setting, cert)
    if key:
        _check_file(setting.replace("cert", "key"), key)
    try:
        ctx.load_cert_chain(cert, key or None)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"{setting}: cannot load certificate {cert} with key "
            f"{key or '(in the same file)'}: {exc}"
        ) from None


def _load_ca(ctx: ssl.SSLContext, setting: str, ca: str) -> None:
    _check_file(setting, ca)
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{setting}: cannot load CA bundle {ca}: {exc}") from None


def client_context(
    ca: str = "", cert: str = "", key: str = "", prefix: str = "nats_tls"
) -> ssl.SSLContext:
    """Verifies the server (against `ca`, or the system's CAs without one) and its name;
    presents `cert` when given (servers that verify clients)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca:
        _load_ca(ctx, f"{prefix}_ca", ca)
    if cert:
        _load_chain(ctx, f"{prefix}_cert", cert, key)
    return ctx


def server_context(cert: str, key: str, ca: str, prefix: str = "kv_tls") -> ssl.SSLContext:
    """Presents `cert` and requires every client to present one that chains to `ca`."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, f"{prefix}_cert", cert, key)
    _load_ca(ctx, f"{prefix}_ca", ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def check_mutual(cert: str, key: str, ca: str, prefix: str = "kv_tls") -> None:
    """Mutual TLS needs all three files; one or two of them is a half-done set-up."""
    given = [bool(cert), bool(key), bool(ca)]
    if any(given) and not all(given):
        raise ValueError(
            f"{prefix}_cert, {prefix}_key and {prefix}_ca go together: set all "
            "three (mutual TLS) or none (plain TCP)"
        )


def kv_contexts(
    cert: str, key: str, ca: str
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(sender's server context, receiver's client context) of the data plane, or
    (None, None) when its TLS is off."""
    check_mutual(cert, key, ca)
    if not cert:
        return None, None
    return (server_context(cert, key, ca), client_context(ca, cert, key, prefix="kv_tls"))
