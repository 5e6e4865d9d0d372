"""Process lifecycle shared by every service: logging, signals, heartbeats, ids, and
`ServiceRuntime`, the start-up every service's `__main__` shares."""

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
from types import TracebackType
from typing import Any, Callable, Coroutine

from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry

from shared import aio, bus, subjects
from shared.messages import InstanceInfo
from shared.metrics import serve_metrics
from shared.settings import BaseSettings

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
        await aio.wait_set(stop, interval_s)


def child_preexec() -> None:
    """For child processes: own process group, and SIGTERM if the parent dies (Linux).

    Its own group means a terminal's Ctrl-C reaches only the supervisor, which then stops
    children in order; the death signal means a killed supervisor leaves no orphans.
    """
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setpgrp()


def run_main(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> int:
    try:
        asyncio.run(coro_fn())
    except KeyboardInterrupt:
        pass
    return 0


class ServiceRuntime:
    """What every service holds while it serves: an exit stack (closed in reverse order of
    what was opened), a stop event set by SIGINT/SIGTERM, the NATS connection, the
    /metrics server, the heartbeat and other background tasks.

        async with ServiceRuntime(settings, instance_id) as rt:
            nc = await rt.connect()
            await rt.serve_metrics(registry)
            rt.heartbeat(info)
            await rt.stopped()  # a signal came
            await rt.join()  # background tasks end once stop is set
    """

    def __init__(self, settings: BaseSettings, instance_id: str) -> None:
        self.settings = settings
        self.instance_id = instance_id
        self.stop = asyncio.Event()
        self.started = time.time()
        self.stack = contextlib.AsyncExitStack()
        self.tasks: list[asyncio.Task[None]] = []
        self._nc: NATS | None = None

    @classmethod
    def named(cls, settings: BaseSettings, role: str, instance_id: str = "") -> ServiceRuntime:
        """For a service that names itself: `instance_id`, or a new one for `role`, and
        logging tagged with it from now on."""
        instance_id = instance_id or new_instance_id(role)
        setup_logging(settings.log_level, role, instance_id)
        return cls(settings, instance_id)

    async def __aenter__(self) -> ServiceRuntime:
        install_stop_signals(self.stop)
        self.started = time.time()
        await self.stack.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self.stack.__aexit__(exc_type, exc, tb)

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("not connected to NATS yet: call connect() first")
        return self._nc

    async def connect(self) -> NATS:
        """The NATS connection (endless reconnects, see shared.bus), closed on exit."""
        self._nc = await bus.connect(self.settings, self.instance_id)
        self.stack.push_async_callback(bus.close, self._nc)
        return self._nc

    async def serve_metrics(self, registry: CollectorRegistry) -> None:
        """GET /metrics on the settings' metrics port (0: none), stopped on exit."""
        await serve_metrics(
            self.stack, registry, self.settings.metrics_host, self.settings.metrics_port
        )

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A background task that ends by itself once `stop` is set (see join)."""
        task = asyncio.create_task(coro)
        self.tasks.append(task)
        return task

    def heartbeat(self, info: Callable[[], InstanceInfo]) -> asyncio.Task[None]:
        """Beat `info()` every heartbeat interval until stop."""
        return self.spawn(
            heartbeat_loop(self.nc, info, self.settings.heartbeat_interval_s, self.stop)
        )

    async def stopped(self) -> None:
        """Until SIGINT or SIGTERM (or someone sets `stop`)."""
        await self.stop.wait()

    async def join(self) -> None:
        """Wait for the background tasks to end (they watch `stop`); a task's failure does
        not keep the others from ending, nor the shutdown from going on."""
        await asyncio.gather(*self.tasks, return_exceptions=True)
