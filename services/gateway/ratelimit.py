"""Per-key request rate limits (moving window, from the `limits` package).

The windows live in this gateway's memory: with several gateways each enforces the
limit on its own share of the traffic.
"""

from __future__ import annotations

import logging
import time

import limits
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter

from services.gateway.keys import parse_rate_limit

log = logging.getLogger(__name__)


class KeyLimiter:
    def __init__(self, default: str = "") -> None:
        self.default = parse_rate_limit(default)
        self._parsed: dict[str, list[limits.RateLimitItem]] = {}
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def limits_for(self, rate_limit: str) -> list[limits.RateLimitItem]:
        if not rate_limit:
            return self.default
        if rate_limit not in self._parsed:
            try:
                self._parsed[rate_limit] = parse_rate_limit(rate_limit)
            except ValueError:  # only a hand-edited row can hold one: fall back, say so once
                log.warning("unparsable rate limit %r; using the default", rate_limit)
                self._parsed[rate_limit] = self.default
        return self._parsed[rate_limit]

    async def hit(self, key_id: str, rate_limit: str = "") -> float | None:
        """Count one request for the key: None if allowed, else seconds until it would be.

        Every window is tested before any is charged, so a request refused by the daily
        limit does not also use up the per-minute one.
        """
        items = self.limits_for(rate_limit)
        for item in items:
            if not await self._limiter.test(item, key_id):
                stats = await self._limiter.get_window_stats(item, key_id)
                return max(0.0, stats.reset_time - time.time())
        for item in items:
            await self._limiter.hit(item, key_id)
        return None
