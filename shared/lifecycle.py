"""Process lifecycle shared by every service: logging, signals, heartbeats, ids."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
import uuid
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS

from shared import subjects
from shared.messages import InstanceInfo

log = logging.getLogger(__name__)


def setup_logging(level: str, service: str, instance_id: str = "") -> None:
    tag = f"{service}:{instance_id}" if instance_id else service
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s",
    )
    # aiohttp's access log and nats' reconnect chatter are noise at INFO.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def new_instance_id(role: str) -> str:
    return f"{role}-{socket.gethostname()[:12]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `stop`; the service then shuts down in order."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


async def publish_heartbeat(nc: NATS, msg: InstanceInfo) -> None:
    """One heartbeat, stamped now; a failure (NATS reconnecting) only skips it."""
    msg.sent_at = time.time()
    try:
        await nc.publish(subjects.heartbeat(msg.role.value, msg.instance_id), msg.encode())
    except Exception as exc:  # noqa: BLE001 - keep beating through reconnects
        log.debug("heartbeat not sent: %s", exc)


async def heartbeat_loop(
    nc: NATS, info: Callable[[], InstanceInfo], interval_s: float, stop: asyncio.Event
) -> None:
    """Publish this instance's state until `stop`; a NATS outage only skips beats."""
    while not stop.is_set():
        await publish_heartbeat(nc, info())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


def child_preexec() -> None:
    """For child processes: own process group, and SIGTERM if the parent dies (Linux).

    Its own group means a terminal's Ctrl-C reaches only the supervisor, which then stops
    children in order; the death signal means a killed supervisor leaves no orphans.
    """
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setpgrp()


def run_main(coro_fn: Callable[[], Awaitable[None]]) -> int:
    try:
        asyncio.run(coro_fn())
    except KeyboardInterrupt:
        pass
    return 0
