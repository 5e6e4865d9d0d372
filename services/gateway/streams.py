"""One request's token stream: NATS events in, ordered TokenEvents out, across faults.

Prefill sends event 0 and decode the rest, over different connections, so arrival
order is not guaranteed: events carry an index and are released strictly in order.

Faults (Follower): the instance holding the request dies (its heartbeats stop, or it
comes back as a new process), an event never arrives (published while NATS restarted:
later ones are here, or the stream falls silent), or a worker reports that it could not
go on. The request is then placed again, as a new *attempt* with its own id (so nothing
of the old one can interleave, and a cancel of the old one cannot touch the new one):
- no token yet: through the conductor, from scratch;
- tokens already streamed: on a live decode instance, which recomputes prompt + tokens so
  far and continues at the next event index with the text already sent, so the client
  sees one stream with no duplicates.
Past `max_replacements` the request ends with a clear error; it never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import AsyncGenerator, Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.gateway.args import GatewaySettings
from shared import aio, bus, errors, subjects
from shared.messages import (
    Ack,
    CancelRequest,
    DecodeJob,
    GenerateRequest,
    InstanceInfo,
    Placement,
    Role,
    TokenEvent,
)

log = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting stream checks its instances while nothing arrives
FORGET_EXPIRIES = 20  # a silent instance is forgotten after this many expiry periods
# Worker error codes that say "not here, not now" rather than "this request is bad".
RETRYABLE = frozenset(
    {"unavailable", "no_responders", "timeout", "instance_lost", "kv_transfer_failed"}
)


class StreamLost(errors.Unavailable):
    """The instance serving the request is gone, or some of its events are."""

    code = "instance_lost"


class TokenStream:
    def __init__(self, nc: NATS, request_id: str, gap_timeout_s: float = 2.0) -> None:
        self.nc = nc
        self.request_id = request_id
        self.gap_timeout_s = gap_timeout_s
        self._pending: dict[int, TokenEvent] = {}
        self._next = 0
        self._arrived = asyncio.Event()
        self._sub: Subscription | None = None

    @property
    def next_index(self) -> int:
        return self._next

    async def open(self) -> TokenStream:
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

    async def retarget(self, request_id: str, next_index: int) -> None:
        """Follow another attempt from `next_index` on; the old attempt's events are dropped."""
        await self.close()
        self.request_id = request_id
        self._pending.clear()
        self._next = next_index
        await self.open()

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = TokenEvent.model_validate_json(msg.data)
        except ValueError:
            log.warning("request %s: malformed token event dropped", self.request_id)
            return
        if event.request_id == self.request_id and event.index >= self._next:
            self._pending[event.index] = event
            self._arrived.set()

    async def events(
        self,
        first_timeout_s: float,
        next_timeout_s: float,
        check: Callable[[int], str | None] | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Yield events in index order until a final one. A silence past the timeout raises
        Timeout; a lost event, or `check(next_index)` naming a reason, raises StreamLost."""
        while True:
            timeout = first_timeout_s if self._next == 0 else next_timeout_s
            event = await self._wait_next(timeout, check)
            self._next += 1
            yield event
            if event.finish_reason is not None:
                return

    async def _wait_next(
        self, timeout_s: float, check: Callable[[int], str | None] | None
    ) -> TokenEvent:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        gap_since: float | None = None
        while self._next not in self._pending:
            self._arrived.clear()
            now = loop.time()
            if self._pending:  # later events are here and this one is not
                gap_since = now if gap_since is None else gap_since
                if now - gap_since > self.gap_timeout_s:
                    raise StreamLost(f"token event {self._next} was lost")
            why = check(self._next) if check is not None else None
            if why:
                raise StreamLost(why)
            remaining = deadline - now
            if remaining <= 0:
                raise errors.Timeout(f"no output for {timeout_s:.0f}s")
            await aio.wait_set(self._arrived, min(remaining, POLL_S))
        return self._pending.pop(self._next)


@dataclass
class _Seen:
    at: float  # when its last heartbeat arrived here (monotonic)
    info: InstanceInfo


class Liveness:
    """Which instances the gateway still hears (pure bookkeeping: time comes in as `now`).

    Silence is measured against the newest heartbeat from anyone, the gateway's own
    included: while the bus is down everyone is silent and nobody is declared dead."""

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        # A dead instance stays listed (as silent: /admin/state, the console) this long,
        # then is forgotten: ids that come and go (restarts, scaling) must not pile up.
        self.forget_s = FORGET_EXPIRIES * expiry_s
        self._seen: dict[str, _Seen] = {}
        self._latest = 0.0

    def beat(self, info: InstanceInfo, now: float) -> None:
        self._seen[info.instance_id] = _Seen(now, info)
        self._latest = max(self._latest, now)
        gone = [iid for iid, s in self._seen.items() if self._latest - s.at > self.forget_s]
        for iid in gone:
            del self._seen[iid]

    def infos(self) -> list[InstanceInfo]:
        """Each instance's last heartbeat, in the order they were first heard."""
        return [s.info for s in self._seen.values()]

    def incarnation(self, instance_id: str) -> float | None:
        seen = self._seen.get(instance_id)
        return seen.info.started_at if seen else None

    def lost(self, instance_id: str, incarnation: float | None) -> str | None:
        """Why `instance_id` no longer holds what it was given (as the process that was
        `incarnation`), or None while it looks alive or was never heard of."""
        seen = self._seen.get(instance_id)
        if seen is None:
            return None
        if incarnation is not None and seen.info.started_at != incarnation:
            return "restarted"
        silent = self._latest - seen.at
        if silent > self.expiry_s:
            return f"no heartbeat for {silent:.1f}s"
        return None

    def pick(self, role: Role, avoid: set[str]) -> str | None:
        """The least loaded live instance of `role`, one not in `avoid` if there is one."""
        live = [
            s
            for s in self._seen.values()
            if s.info.role == role
            and s.info.status == "ready"
            and self._latest - s.at <= self.expiry_s
        ]
        if not live:
            return None
        best = min(
            live, key=lambda s: (s.info.instance_id in avoid, s.info.queue_depth + s.info.running)
        )
        return best.info.instance_id


@dataclass
class Attempt:
    request_id: str
    prefill_id: str  # "" when a decode instance recomputes the request (a re-placement)
    decode_id: str  # "" when the prefill instance decodes too (colocated)
    incarnations: dict[str, float | None] = field(default_factory=dict)

    def responsible(self, next_index: int) -> list[str]:
        """Who must be alive for event `next_index` to come."""
        if not self.prefill_id or not self.decode_id:
            return [self.decode_id or self.prefill_id]
        if next_index == 0:
            return [self.prefill_id]
        if next_index == 1:  # the handoff: prefill offers the KV, decode fetches it
            return [self.prefill_id, self.decode_id]
        return [self.decode_id]


class Follower:
    """Follows one request's events across instance failures (see the module doc)."""

    def __init__(
        self,
        nc: NATS,
        settings: GatewaySettings,
        liveness: Liveness,
        stream: TokenStream,
        gen: GenerateRequest,
        place: Callable[[GenerateRequest], Awaitable[Placement]],
        on_placed: Callable[[str, str], None] | None = None,
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.liveness = liveness
        self.stream = stream
        self.gen = gen
        self.place = place
        self.on_placed = on_placed
        self.attempt: Attempt | None = None
        self.replacements = 0
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []

    def placed(self, placement: Placement) -> None:
        self.attempt = self._attempt(
            placement.request_id, placement.prefill_id, placement.decode_id
        )

    def _attempt(self, request_id: str, prefill_id: str, decode_id: str) -> Attempt:
        ids = [i for i in (prefill_id, decode_id) if i]
        return Attempt(
            request_id, prefill_id, decode_id, {i: self.liveness.incarnation(i) for i in ids}
        )

    def check(self, next_index: int) -> str | None:
        a = self.attempt
        if a is None:
            return None
        for iid in a.responsible(next_index):
            if a.incarnations.get(iid) is None:  # first heard of after placement
                a.incarnations[iid] = self.liveness.incarnation(iid)
            why = self.liveness.lost(iid, a.incarnations[iid])
            if why:
                return f"instance {iid} lost the request: {why}"
        return None

    async def events(self) -> AsyncGenerator[TokenEvent, None]:
        s = self.settings
        while True:
            try:
                async with contextlib.aclosing(
                    self.stream.events(s.first_token_timeout_s, s.token_timeout_s, self.check)
                ) as events:
                    async for event in events:
                        err = event.error
                        if (
                            err is not None
                            and err.code in RETRYABLE
                            and self.replacements < s.max_replacements
                        ):
                            raise StreamLost(f"{event.instance_id or 'worker'}: {err.message}")
                        self.token_ids += event.token_ids
                        if event.text:
                            self.text_parts.append(event.text)
                        yield event
                return
            except (StreamLost, errors.Timeout) as exc:
                if self.replacements >= s.max_replacements:
                    raise
                self.replacements += 1
                log.warning(
                    "request %s: %s; placing it again (%d of %d)",
                    self.gen.request_id,
                    exc.message,
                    self.replacements,
                    s.max_replacements,
                )
                await self._replace(exc.message)

    async def _replace(self, why: str) -> None:
        assert self.attempt is not None
        await self.cancel(f"placed again: {why}")
        new_id = f"{self.gen.request_id}-r{self.replacements}"
        gen = self.gen.model_copy(update={"request_id": new_id})
        if not self.token_ids:
            # Nothing streamed yet: start over through the conductor (subscribed first).
            await self.stream.retarget(new_id, 0)
            placement = await self.place(gen)
            self.placed(placement)
        else:
            await self.stream.retarget(new_id, self.stream.next_index)
            decode_id = await self._continue_on_decode(gen)
            self.attempt = self._attempt(new_id, "", decode_id)
        if self.on_placed is not None:
            self.on_placed(self.attempt.prefill_id, self.attempt.decode_id)

    async def _continue_on_decode(self, gen: GenerateRequest) -> str:
        """Hand prompt + tokens so far to a live decode instance; returns its id."""
        assert self.attempt is not None
        job = DecodeJob(
            request=gen,
            prefill_id="",
            kv=None,
            output_token_ids=list(self.token_ids),
            emitted_text="".join(self.text_parts),
            events_sent=self.stream.next_index,
        )
        avoid = {self.attempt.decode_id}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.replace_wait_s
        last = "no live decode instance"
        while True:
            decode_id = self.liveness.pick(Role.DECODE, avoid)
            if decode_id is not None:
                try:
                    await bus.request(
                        self.nc, subjects.decode_submit(decode_id), job, Ack, timeout_s=5.0
                    )
                    return decode_id
                except errors.HalfmoonError as exc:
                    last = f"decode {decode_id}: {exc.message}"
                    avoid.add(decode_id)
            if loop.time() >= deadline:
                raise errors.Unavailable(
                    f"request could not continue elsewhere ({last})", code="instance_lost"
                )
            await asyncio.sleep(POLL_S)

    async def cancel(self, reason: str) -> None:
        """Stop the current attempt wherever it is."""
        rid = self.attempt.request_id if self.attempt is not None else self.gen.request_id
        await publish_cancel(self.nc, rid, reason)


async def publish_cancel(nc: NATS, request_id: str, reason: str) -> None:
    """Tell every instance to drop `request_id` (best effort: workers also time out)."""
    try:
        await nc.publish(
            subjects.CANCEL, CancelRequest(request_id=request_id, reason=reason).encode()
        )
    except Exception as exc:  # noqa: BLE001
        log.warning("request %s: cancel not sent: %s", request_id, exc)
