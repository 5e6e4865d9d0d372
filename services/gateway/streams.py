"""One request's token stream: NATS events in, ordered TokenEvents out.

Prefill sends event 0 and decode the rest, over different connections, so arrival
order is not guaranteed: events carry an index and are released strictly in order.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import errors, subjects
from shared.messages import TokenEvent

log = logging.getLogger(__name__)


class TokenStream:
    def __init__(self, nc: NATS, request_id: str) -> None:
        self.nc = nc
        self.request_id = request_id
        self._pending: dict[int, TokenEvent] = {}
        self._next = 0
        self._arrived = asyncio.Event()
        self._sub: Subscription | None = None

    async def open(self) -> "TokenStream":
        # Subscribe before the request is dispatched so the first token cannot be missed.
        self._sub = await self.nc.subscribe(subjects.tokens(self.request_id), cb=self._on_msg)
        return self

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone already
                pass
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = TokenEvent.model_validate_json(msg.data)
        except ValueError:
            log.warning("request %s: malformed token event dropped", self.request_id)
            return
        if event.index >= self._next:
            self._pending[event.index] = event
            self._arrived.set()

    async def events(self, first_timeout_s: float, next_timeout_s: float) -> AsyncIterator[TokenEvent]:
        """Yield events in index order until a final one; a silence past the timeout raises."""
        while True:
            timeout = first_timeout_s if self._next == 0 else next_timeout_s
            event = await self._wait_next(timeout)
            self._next += 1
            yield event
            if event.finish_reason is not None:
                return

    async def _wait_next(self, timeout_s: float) -> TokenEvent:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._next not in self._pending:
            self._arrived.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise errors.Timeout(f"no output for {timeout_s:.0f}s")
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return self._pending.pop(self._next)
