"""Conductor leader election: one active conductor, the others warm standbys.

The lease is one key in a JetStream key-value bucket whose entries expire after `ttl_s`
(the bucket's max age). A candidate becomes leader by `create`-ing the key, which succeeds
only if no live entry exists; the leader renews it every `renew_s` with `update(last=rev)`,
which succeeds only if nobody wrote the key since. A leader that dies stops renewing, its
entry expires after `ttl_s` (the server's expiry, measured from when it stored the write),
and the next standby poll takes the key. A leader that cannot renew (partitioned, server
gone) steps down by its own clock at `sent + ttl_s - renew_s / 2` of its last successful
renewal: the server cannot expire the entry before `sent + ttl_s`, so the old leader stops
placing before anyone else can start. A leader told that someone else wrote the key steps
down at once.

`Lease` is the state machine (pure: outcomes and time come in as arguments); `Election`
drives it with the KV calls and tells the conductor when it is elected or deposed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.js.api import StorageType
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared import aio

log = logging.getLogger(__name__)

BUCKET = "halfmoon_conductor"
KEY = "leader"


class State(StrEnum):
    STANDBY = "standby"
    LEADER = "leader"


@dataclass
class Lease:
    """What this candidate knows about its lease; every method returns True when the
    state changed (standby -> leader or leader -> standby)."""

    ttl_s: float
    renew_s: float
    state: State = State.STANDBY
    revision: int = 0  # KV revision of our latest write (the next update's `last`)
    term: int = 0  # revision at which we were elected: grows with every new term
    valid_until: float = 0.0  # monotonic time by which we must have stepped down

    def __post_init__(self) -> None:
        if not 0 < 2 * self.renew_s <= self.ttl_s:
            raise ValueError(
                f"renew interval {self.renew_s}s must be at most half the lease "
                f"TTL {self.ttl_s}s, or one late renewal loses the lease"
            )

    @property
    def is_leader(self) -> bool:
        return self.state is State.LEADER

    def _deadline(self, sent_at: float) -> float:
        return sent_at + self.ttl_s - self.renew_s / 2

    def acquired(self, revision: int, sent_at: float) -> bool:
        """Our create() succeeded (it was sent at `sent_at`)."""
        if self.is_leader:
            raise RuntimeError("acquired a lease we already hold")
        self.state, self.revision, self.term = State.LEADER, revision, revision
        self.valid_until = self._deadline(sent_at)
        return True

    def renewed(self, revision: int, sent_at: float) -> bool:
        """Our update(last=revision) succeeded."""
        if not self.is_leader:
            raise RuntimeError("renewed a lease we do not hold")
        self.revision = revision
        self.valid_until = self._deadline(sent_at)
        return False

    def taken(self) -> bool:
        """The key holds someone else's write: if we led, we no longer do."""
        return self._step_down()

    def failed(self, now: float) -> bool:
        """A KV call failed (timeout, no connection): we lead only until our deadline."""
        return self.expired(now)

    def expired(self, now: float) -> bool:
        if self.is_leader and now >= self.valid_until:
            return self._step_down()
        return False

    def released(self) -> bool:
        return self._step_down()

    def _step_down(self) -> bool:
        was = self.is_leader
        self.state, self.revision, self.valid_until = State.STANDBY, 0, 0.0
        return was


Callback = Callable[[], Awaitable[None]]


class Election:
    """Drives a `Lease` against the bucket until `stop`; `on_elected` / `on_deposed` run on
    each change (deposed is called after `is_leader` is already False, so work in flight
    can check it before doing anything irreversible)."""

    def __init__(
        self,
        nc: NATS,
        candidate: str,
        ttl_s: float,
        renew_s: float,
        on_elected: Callback,
        on_deposed: Callback,
        replicas: int = 1,
        bucket: str = BUCKET,
    ) -> None:
        self.nc = nc
        self.candidate = candidate
        self.lease = Lease(ttl_s, renew_s)
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.replicas = replicas
        self.bucket = bucket
        # A fresh value per process: a restarted conductor with the same id is a new holder.
        self._value = json.dumps({"holder": candidate, "nonce": uuid.uuid4().hex}).encode()
        self._kv: KeyValue | None = None

    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader

    @property
    def term(self) -> int:
        return self.lease.term if self.lease.is_leader else 0

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign and renew until `stop`; then step down and release the key at once."""
        try:
            while not stop.is_set():
                await self.step()
                # Standbys poll twice per renewal period: a dead leader is replaced within
                # ttl + expiry lag + renew_s / 2.
                pause = self.lease.renew_s if self.is_leader else self.lease.renew_s / 2
                if self.is_leader:
                    pause = max(0.0, min(pause, self.lease.valid_until - time.monotonic()))
                await aio.wait_set(stop, pause)
        finally:
            await self.resign()

    async def step(self) -> None:
        """One campaign (standby) or renewal (leader) attempt."""
        if self.lease.expired(time.monotonic()):
            await self._deposed("lease expired before it could be renewed")
        sent_at = time.monotonic()
        try:
            if self.is_leader:
                # Never wait past our deadline: by then we must have stepped down. Opening
                # the bucket again (after a failed renewal) counts against the same budget.
                budget = max(0.01, self.lease.valid_until - sent_at)
                async with asyncio.timeout(budget):
                    rev = await self._renew()
                self.lease.renewed(rev, sent_at)
            else:
                kv = await self._bucket()
                rev = await kv.create(KEY, self._value)
                self.lease.acquired(rev, sent_at)
                await self._elected()
        except KeyWrongLastSequenceError:
            if self.lease.taken():
                await self._deposed("another conductor holds the lease")
        except Exception as exc:  # noqa: BLE001 - any bus failure: same rule, by the clock
            # Open the bucket again next time: a restarted server may have lost it (memory
            # storage), and creating it is idempotent.
            self._kv = None
            log.debug("lease %s failed: %s", "renewal" if self.is_leader else "campaign", exc)
            if self.lease.failed(time.monotonic()):
                await self._deposed(f"could not renew the lease: {exc!r}")

    async def _renew(self) -> int:
        kv = await self._bucket()
        return await kv.update(KEY, self._value, last=self.lease.revision)

    async def resign(self) -> None:
        """Step down and delete our entry so a standby takes over without waiting for TTL."""
        revision = self.lease.revision
        if not self.lease.released():
            return
        await self._deposed("resigning")
        try:
            async with asyncio.timeout(self.lease.renew_s):
                kv = await self._bucket()
            async with asyncio.timeout(self.lease.renew_s):
                await kv.delete(KEY, last=revision)
        except Exception as exc:  # noqa: BLE001 - it expires by itself anyway
            log.info("lease not released (%r); it expires within %.1fs", exc, self.lease.ttl_s)

    async def _elected(self) -> None:
        log.info("%s is the leader (term %d)", self.candidate, self.lease.term)
        try:
            await self.on_elected()
        except Exception:
            log.exception("taking over failed; giving the lease back")
            await self.resign()

    async def _deposed(self, why: str) -> None:
        level = logging.INFO if why == "resigning" else logging.WARNING
        log.log(level, "%s is no longer the leader: %s", self.candidate, why)
        await self.on_deposed()

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            js = self.nc.jetstream(timeout=self.lease.renew_s)
            try:
                self._kv = await js.create_key_value(
                    bucket=self.bucket,
                    ttl=self.lease.ttl_s,
                    history=1,
                    storage=StorageType.MEMORY,
                    replicas=self.replicas,
                    description="halfmoon conductor leader lease",
                )
            except BadRequestError as exc:
                # Made by a conductor with other settings: use it as it is, but say so.
                log.warning(
                    "lease bucket %s exists with another configuration (%s); using it",
                    self.bucket,
                    exc.description,
                )
                kv = await js.key_value(self.bucket)
                self._adopt_ttl((await kv.status()).ttl)
                self._kv = kv
        return self._kv

    def _adopt_ttl(self, bucket_ttl_s: float | None) -> None:
        """Our deadline must follow the bucket's real TTL when it is shorter than ours, or
        we would lead past the moment a standby can take the key."""
        if bucket_ttl_s and bucket_ttl_s < self.lease.ttl_s:
            log.warning(
                "lease bucket %s expires entries after %.2fs, not %.2fs: using %.2fs",
                self.bucket,
                bucket_ttl_s,
                self.lease.ttl_s,
                bucket_ttl_s,
            )
            if 2 * self.lease.renew_s > bucket_ttl_s:
                log.error(
                    "renewing every %.2fs is too slow for that TTL: leadership will flap",
                    self.lease.renew_s,
                )
            self.lease.ttl_s = bucket_ttl_s
