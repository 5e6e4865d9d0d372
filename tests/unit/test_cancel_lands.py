"""A cancel that lands in the same loop step as the thing being waited for still cancels.

On Python 3.11 `asyncio.wait_for` returns the inner result and drops such a cancel
(fixed in 3.12). A gateway waiting on a stream that is still producing tokens is exactly
that case: a client that left a non-streaming request was not cancelled, and decode ran
the request to its last token (CI, test_openai_surface's leaver test)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.gateway.streams import TokenStream
from shared import aio
from shared.messages import TokenEvent


def event_msg(index: int) -> SimpleNamespace:
    event = TokenEvent(request_id="r", index=index, token_ids=[index], text="x")
    return SimpleNamespace(data=event.model_dump_json().encode())


async def settle() -> None:
    """Let every ready task run until it blocks (a handful of loop steps)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_stream_consumer_cancelled_as_an_event_arrives_stops():
    stream = TokenStream(nc=None, request_id="r")  # type: ignore[arg-type]  # never opened
    got: list[int] = []

    async def consume() -> None:
        async for event in stream.events(60.0, 60.0):
            got.append(event.index)

    task = asyncio.create_task(consume())
    await stream._on_msg(event_msg(0))  # type: ignore[arg-type]
    await settle()
    assert got == [0]  # now waiting for event 1
    await stream._on_msg(event_msg(1))  # type: ignore[arg-type]
    task.cancel()  # in the same step as the event
    await asyncio.wait({task}, timeout=5)  # a dropped cancel waits 60 s for event 2
    assert task.cancelled() and got == [0]


async def test_wait_set_returns_on_set_and_on_timeout_and_passes_a_cancel_on():
    event = asyncio.Event()
    assert await aio.wait_set(event, 0.01) is False
    event.set()
    assert await aio.wait_set(event, 60.0) is True

    event.clear()
    task = asyncio.create_task(aio.wait_set(event, 60.0))
    await settle()
    event.set()
    task.cancel()  # in the same step as the set
    with pytest.raises(asyncio.CancelledError):
        await task
