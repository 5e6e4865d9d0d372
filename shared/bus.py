"""NATS connection and typed request/reply helpers."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from pydantic import BaseModel

from shared import errors, tls
from shared.messages import ErrorBody, Message
from shared.settings import BaseSettings

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


async def connect(settings: BaseSettings, name: str) -> NATS:
    """Connect with endless reconnects: a NATS restart must not end a service.

    Unlimited attempts 0.5 s apart: the first connect waits for a server that is not up
    yet, and after a restart every subscription is re-sent by nats-py (what was published
    meanwhile is buffered and flushed, up to pending_size). Pings every 10 s notice a
    server that vanished without closing the socket (a partition) within ~30 s.
    """

    async def on_error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")

    return await nats.connect(
        servers=settings.nats_url.split(","),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=10,
        max_outstanding_pings=3,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **security_options(settings),
    )


def security_options(settings: BaseSettings) -> dict[str, Any]:
    """nats.connect's credential and TLS arguments from the settings (none: a plain,
    anonymous connection, as on one host)."""
    opts: dict[str, Any] = {}
    if settings.nats_user:
        opts.update(user=settings.nats_user, password=settings.nats_password)
    if settings.nats_creds:
        # nats-py signs the server's nonce with the NKey seed through the nkeys package,
        # and would only say so at the first connect, inside its reconnect loop.
        if importlib.util.find_spec("nkeys") is None:
            raise ValueError("nats_creds needs the nkeys package: pip install nkeys")
        opts["user_credentials"] = str(Path(settings.nats_creds).expanduser())
    urls = settings.nats_url.split(",")
    if (
        settings.nats_tls_ca
        or settings.nats_tls_cert
        or any(u.strip().startswith("tls://") for u in urls)
    ):
        opts["tls"] = tls.client_context(
            settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key
        )
        if settings.nats_tls_hostname:
            opts["tls_hostname"] = settings.nats_tls_hostname
    return opts


async def close(nc: NATS, timeout_s: float = 5.0) -> None:
    """Drain (finish in-flight callbacks) if connected, else just close."""
    try:
        if nc.is_connected:
            async with asyncio.timeout(timeout_s):
                await nc.drain()
    except Exception as exc:  # noqa: BLE001 - shutting down: nothing left to protect
        log.debug("nats drain failed: %s", exc)
    finally:
        if not nc.is_closed:
            await nc.close()


def encode_error(exc: errors.HalfmoonError) -> bytes:
    body = ErrorBody(
        code=exc.code, message=exc.message, retry_after_s=exc.retry_after_s, status=exc.status
    )
    return json.dumps({"error": body.model_dump()}).encode()


def decode_reply(data: bytes, cls: type[M]) -> M:
    """Parse a reply that is either `cls` or {"error": ErrorBody}; the latter is raised."""
    obj = json.loads(data)
    if isinstance(obj, dict) and "error" in obj and isinstance(obj["error"], dict):
        err = ErrorBody.model_validate(obj["error"])
        raise errors.from_code(err.code, err.message, err.retry_after_s, err.status)
    return cls.model_validate(obj)


async def request(nc: NATS, subject: str, msg: Message, cls: type[M], timeout_s: float) -> M:
    """Typed request/reply; bus failures become typed Halfmoon errors."""
    try:
        reply = await nc.request(subject, msg.encode(), timeout=timeout_s)
    except NoRespondersError as exc:
        raise errors.Unavailable(f"no responders on {subject}", code="no_responders") from exc
    except NatsTimeout as exc:
        raise errors.Timeout(f"no reply on {subject} within {timeout_s:.1f}s") from exc
    return decode_reply(reply.data, cls)


async def respond(msg: Msg, payload: Message | errors.HalfmoonError) -> None:
    if not msg.reply:
        return
    data = encode_error(payload) if isinstance(payload, errors.HalfmoonError) else payload.encode()
    await msg.respond(data)
