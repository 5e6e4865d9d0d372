"""Waiting with a time limit, without losing a cancel.

Not `asyncio.wait_for`: on Python 3.11 a cancel that lands in the same loop step as the
awaited thing finishing is dropped (wait_for returns the result; fixed in 3.12 by
rebuilding it on `asyncio.timeout`). A loop waiting on an event that fires often, such as a
token stream or a worker's wake-up, then runs on after its task was cancelled: a gateway
whose client had left kept the request decoding to its last token. `asyncio.timeout`
does not have the fault, so every time-limited wait in this code uses it.
"""

from __future__ import annotations

import asyncio
import contextlib


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` has passed; whether it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    return event.is_set()
