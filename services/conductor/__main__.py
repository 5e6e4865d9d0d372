"""`python -m services.conductor` / `halfmoon serve conductor`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Awaitable, Callable, Sequence

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from services.conductor import orphans
from services.conductor.args import ConductorSettings, parse_args
from services.conductor.handlers import Conductor
from services.conductor.leader import Election
from shared import aio, subjects
from shared.db.records import RecordWriter
from shared.db.session import make_engine
from shared.lifecycle import ServiceRuntime, publish_heartbeat, run_main
from shared.messages import InstanceInfo, Role

log = logging.getLogger("services.conductor")


async def _sweep(conductor: Conductor, stop: asyncio.Event, interval_s: float) -> None:
    while not stop.is_set():
        conductor.sweep()
        await aio.wait_set(stop, interval_s)


async def _settle_orphans(conductor: Conductor, stop: asyncio.Event, interval_s: float) -> None:
    """Role switches left draining by a conductor that stopped (orphans.py), while leading."""
    while not stop.is_set():
        await aio.wait_set(stop, interval_s)
        try:
            await orphans.settle(conductor)
        except Exception:  # a database fault must not end the loop: the next one retries
            log.exception("settling orphaned role switches failed")


class Intake:
    """The subscriptions only a conductor that may place holds: placement, role switches
    and new decode instances for refused handoffs."""

    def __init__(self, nc: NATS, conductor: Conductor) -> None:
        self.nc = nc
        self.conductor = conductor
        self._subs: list[Subscription] = []

    async def open(self) -> None:
        if self._subs:
            return
        c, queue = self.conductor, subjects.CONDUCTOR_QUEUE
        for subject, cb in (
            (subjects.CONDUCTOR_SCHEDULE, c.on_schedule),
            (subjects.CONDUCTOR_ROLE, c.roles.on_role),
            (subjects.CONDUCTOR_REDECODE, c.roles.on_redecode),
        ):
            self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=cb))
        await self.nc.flush()  # the server routes requests here from now on

    async def close(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):  # a closed connection unsubscribed already
                await sub.unsubscribe()


def make_election(
    settings: ConductorSettings,
    nc: NATS,
    instance_id: str,
    intake: Intake,
    announce: Callable[[], Awaitable[None]],
) -> Election | None:
    if not settings.election:
        return None

    async def elected() -> None:
        await intake.open()
        await announce()

    async def deposed() -> None:
        await intake.close()
        await announce()

    return Election(
        nc,
        instance_id,
        settings.lease_ttl_s,
        settings.lease_renew_s,
        on_elected=elected,
        on_deposed=deposed,
        replicas=settings.lease_replicas,
    )


async def _campaign(election: Election, stop: asyncio.Event, settings: ConductorSettings) -> None:
    # One heartbeat period first, so that a fresh conductor knows the instances before it can
    # lead (and a warm standby wins against it when a leader dies).
    await aio.wait_set(stop, settings.heartbeat_interval_s)
    await election.run(stop)


def _info(
    rt: ServiceRuntime, conductor: Conductor, election: Election | None
) -> Callable[[], InstanceInfo]:
    """What this conductor's heartbeat says, read fresh for each beat."""
    settings = conductor.settings
    placement_fields = {
        "policy",
        "ttft_slo_ms",
        "tbt_slo_ms",
        "slo_margin",
        "balancing_threshold",
        "layout",
        # the P/D planner's: a simulator replaying this run runs the same planner
        "planner",
        "planner_interval_s",
        "planner_window_s",
        "planner_min_gain",
        "planner_cooldown_s",
        "planner_horizon_s",
        # hot-prefix replication's: the simulator runs the same plan
        "replicate",
        "replicate_max_busy",
        "replicate_blocks_per_s",
        "replicate_mib_per_s",
    }

    def info() -> InstanceInfo:
        return InstanceInfo(
            instance_id=rt.instance_id,
            role=Role.CONDUCTOR,
            pid=os.getpid(),
            started_at=rt.started,
            leader=conductor.leading(),
            term=election.term if election else 0,
            cost_model=conductor.cost.source,
            cost_samples_seen={
                "prefill": conductor.calibrator.prefill.seen,
                "decode": conductor.calibrator.decode.seen,
                "handoff": conductor.calibrator.handoffs_seen,
            },
            cost_params=conductor.cost.params(),
            cpu_cost_params=conductor.calibrator.cpu_params(),
            placement=settings.model_dump(include=placement_fields),
        )

    return info


async def serve(settings: ConductorSettings) -> None:
    async with ServiceRuntime.named(settings, "conductor", settings.instance_id) as rt:
        engine = make_engine(settings.database_url)
        rt.stack.push_async_callback(engine.dispose)
        records = RecordWriter(engine)
        await records.start()
        rt.stack.push_async_callback(records.close)
        nc = await rt.connect()
        conductor = Conductor(settings, nc, records)
        await rt.serve_metrics(conductor.metrics.registry)
        # Every conductor tracks heartbeats, standbys too, so a new leader starts warm.
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=conductor.on_heartbeat)
        intake = Intake(nc, conductor)
        info: Callable[[], InstanceInfo]  # it reads the election, which announces with it
        # A change of leader is news at once, not at the next beat.
        election = make_election(
            settings, nc, rt.instance_id, intake, lambda: publish_heartbeat(nc, info())
        )
        info = _info(rt, conductor, election)
        conductor.leading = lambda: election is None or election.is_leader
        rt.heartbeat(info)
        rt.spawn(_sweep(conductor, rt.stop, settings.heartbeat_expiry_s / 3))
        rt.spawn(_settle_orphans(conductor, rt.stop, settings.heartbeat_expiry_s))
        if settings.planner != "off":
            rt.spawn(conductor.planning.run(rt.stop))
        if election is None:
            await intake.open()
        else:
            rt.spawn(_campaign(election, rt.stop, settings))
        log.info(
            "conductor %s ready (policy %s, %s)",
            rt.instance_id,
            settings.policy,
            "active/standby" if election else "no election: placing",
        )
        await rt.stopped()
        # Intake first (the election resigns and unsubscribes), then the rest.
        await rt.join()
        await intake.close()
        log.info("conductor %s stopped", rt.instance_id)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
