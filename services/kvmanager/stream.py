"""The KV event stream: JetStream keeps every instance's stored/removed/cleared events so
a restarted KV manager (or a second one) rebuilds the index by replaying them.

Instances publish plain core-NATS messages on the subject; the stream captures them.
Each instance publishes `cleared` when it starts, so a replay from the beginning ends in
the right state even for instances that restarted. The stream is bounded by age and size:
if old events fall off, the rebuilt index can only miss blocks (fewer hits, a pull that
finds nothing and recomputes), never invent a wrong one (pulled blocks are hash-checked).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError

from shared import subjects

log = logging.getLogger(__name__)

STREAM = "HALFMOON_KV"


def stream_config(max_age_s: float, max_bytes: int, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=STREAM,
        subjects=[subjects.KV_EVENTS],
        max_age=max_age_s,
        max_bytes=max_bytes,
        num_replicas=replicas,
    )


async def ensure_stream(nc: NATS, max_age_s: float, max_bytes: int, replicas: int = 1) -> None:
    js = nc.jetstream()
    config = stream_config(max_age_s, max_bytes, replicas)
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with other limits (an older deployment): bring them up to date.
        await js.update_stream(config)


async def replay_and_follow(
    nc: NATS, cb: Callable[[Msg], Awaitable[None]]
) -> JetStreamContext.PushSubscription:
    """An ordered consumer from the first stored event on: the replay, then live events."""
    js = nc.jetstream()
    info = await js.stream_info(STREAM)
    log.info("replaying %d KV events from stream %s", info.state.messages, STREAM)
    # The idle heartbeat is how an ordered consumer notices that its server went away (a
    # NATS restart) and re-creates itself from the last event it saw: 1 s resumes the
    # follow ~2 s after a restart (the default 5 s took ~20 s here). Nothing is lost meanwhile:
    # the stream keeps the events.
    return await js.subscribe(
        subjects.KV_EVENTS,
        stream=STREAM,
        cb=cb,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
        idle_heartbeat=1.0,
    )
