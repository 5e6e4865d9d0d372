"""Waiting on conditions, never on the clock.

A test that needs something to have happened (a heartbeat handled, a record written, a
log line printed) waits for exactly that with `until`. Its deadline is only a failure
bound: on a fast machine the wait ends the moment the condition holds, and on a slow one
there is still room, so it is generous (FAILURE_S unless a test says otherwise).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

FAILURE_S = 30.0


async def until(
    cond: Callable[[], Any],
    timeout_s: float = FAILURE_S,
    what: str = "the condition",
    step_s: float = 0.02,
) -> Any:
    """Poll `cond` (sync or async) until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        await asyncio.sleep(step_s)
