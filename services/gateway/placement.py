"""Placing a request: the conductor's reply, asked again while no conductor leads, and a
new attempt when the placement timed out. `ConductorPlacer` is the `Placer` (runs.py) a
request's fan-out uses."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS

from services.gateway.args import GatewaySettings
from services.gateway.life import RequestLife
from services.gateway.metrics import GatewayMetrics
from services.gateway.streams import publish_cancel
from shared import bus, errors, subjects
from shared.db.records import RecordWriter
from shared.db.schema import RequestStatus
from shared.messages import GenerateRequest, Placement

log = logging.getLogger(__name__)


class ConductorPlacer:
    def __init__(
        self,
        settings: GatewaySettings,
        nc: NATS,
        records: RecordWriter,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.records = records
        self.metrics = metrics

    async def place(
        self,
        gen: GenerateRequest,
        life: RequestLife,
        retarget: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> Placement:
        """The placement, or the refusal recorded in `life` and counted, then raised.
        `retarget` (the token stream's) lets a timed-out placement try a new attempt id."""
        try:
            try:
                placement = await self.ask_conductor(gen)
            except errors.Timeout:
                # The conductor may have dispatched it after all: make sure nobody computes it.
                await publish_cancel(self.nc, gen.request_id, "placement timed out")
                if retarget is None:
                    raise
                placement = await self._place_new_attempt(gen, retarget)
            life.dispatch_time = time.time()  # the prefill instance has acknowledged the job
            return placement
        except errors.HalfmoonError as exc:
            self.metrics.rejected(exc)
            life.status = RequestStatus.REJECTED if exc.status == 429 else RequestStatus.FAILED
            life.error = f"{exc.code}: {exc.message}"
            raise

    async def _place_new_attempt(
        self, gen: GenerateRequest, retarget: Callable[[str, int], Awaitable[None]]
    ) -> Placement:
        """The placement timed out: most likely the leading conductor took the request and
        died before dispatching it (a failover). It may also have dispatched it late, so
        that id is cancelled everywhere (by the caller) and the request placed once more
        under a new attempt id: the stream follows only the new one, so nothing is lost and
        nothing is doubled."""
        log.warning(
            "request %s: placement timed out; cancelled it, placing a new attempt", gen.request_id
        )
        self.metrics.retries.labels("placement_timeout").inc()
        again = gen.model_copy(update={"request_id": f"{gen.request_id}-t1"})
        await retarget(again.request_id, 0)
        try:
            return await self.ask_conductor(again)
        except errors.Timeout:
            await publish_cancel(self.nc, again.request_id, "placement timed out twice")
            raise

    async def ask_conductor(self, gen: GenerateRequest) -> Placement:
        """The conductor's placement. While no conductor leads (the leader died and a standby
        has not taken over yet: no responders, or a deposed leader's "not_leader"), nobody
        dispatched the request, so asking again is safe: retry with backoff until
        schedule_retry_s, then fail with 503. A timeout is not retried: the conductor that
        timed out may have dispatched it (the caller cancels it instead)."""
        deadline = time.monotonic() + self.settings.schedule_retry_s
        pause = first_pause = 0.05
        while True:
            try:
                return await bus.request(
                    self.nc,
                    subjects.CONDUCTOR_SCHEDULE,
                    gen,
                    Placement,
                    timeout_s=self.settings.schedule_timeout_s,
                )
            except errors.Unavailable as exc:
                if exc.code not in ("no_responders", "not_leader"):
                    raise
                if time.monotonic() + pause > deadline:
                    raise errors.Unavailable(
                        f"no conductor is placing requests (asked for "
                        f"{self.settings.schedule_retry_s:.0f}s): {exc.message}",
                        code="no_conductor",
                        retry_after_s=2.0,
                    ) from exc
                if pause == first_pause:  # once per request
                    self.metrics.retries.labels("no_conductor").inc()
                # Once per request at INFO: during a failover every request passes here.
                log.log(
                    logging.INFO if pause == first_pause else logging.DEBUG,
                    "request %s: %s; asking again for up to %.1fs",
                    gen.request_id,
                    exc.message,
                    deadline - time.monotonic(),
                )
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.5)

    def placed_again(self, request_id: str, prefill_id: str, decode_id: str) -> None:
        """A fault moved the request (streams.Follower): its record names the new instances."""
        self.metrics.retries.labels("stream_lost").inc()
        values = {"prefill_instance": prefill_id} if prefill_id else {}
        self.records.request_update(request_id, decode_instance=decode_id or prefill_id, **values)
