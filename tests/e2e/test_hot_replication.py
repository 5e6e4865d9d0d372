"""Hot-prefix replication, live: a system prompt that many requests share turns hot on
the one prefill instance holding it, and the conductor has it copied to the other prefill
instance ahead of demand, with no request placed there.

largest_prefix places every request on the instance holding the most of its prompt, so
without a copy the holder takes them all (and nothing else ever caches the prefix: that
policy never pulls). The replication budget is left at its default; its trigger is made
easy (`HALFMOON_REPLICATE_MAX_BUSY`: a holder should spend at most 1% of its time on one
prefix), since this small model's prefill past the prefix takes only milliseconds."""

from __future__ import annotations

import re

import nats
import pytest
from sqlalchemy import select

from services.gateway.prompt import PromptBuilder
from shared import bus, subjects
from shared.db.schema import ReplicationRecord, RequestRecord
from shared.db.session import make_engine, sessionmaker
from shared.hashing import block_hashes
from shared.kv_messages import KVMatchReply, KVMatchRequest
from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_prefix_pull import MODEL, STORY, chat, placed_on
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
SYSTEM = "You answer questions about this story, briefly. " + STORY


def messages(i: int) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question {i}: what did the keeper note on night {i}?"},
    ]


def shared_prefix_hashes(model_dir) -> list[int]:
    """The full blocks every request starts with (the system prompt, as templated)."""
    build = PromptBuilder(model_dir, MODEL, 16)
    a, b = build.tokenize(messages(1)), build.tokenize(messages(2))
    n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return block_hashes(a[: n - n % 16], 16)


@pytest.fixture
def stack(tmp_path, model_dir):
    url, _ = make_database("sqlite", tmp_path)
    env = {"HALFMOON_REPLICATE_MAX_BUSY": "0.01", "HALFMOON_HOT_RPS": "0.3"}
    s = start_stack(
        tmp_path,
        model_dir,
        url,
        ["--dtype", "float32", "--prefill", "2", "--policy", "largest_prefix"],
        env=env,
    )
    yield s
    assert stop_stack(s) == 0


async def test_a_hot_system_prompt_is_copied_to_the_other_prefill_instance(stack, model_dir):
    hashes = shared_prefix_hashes(model_dir)
    assert len(hashes) >= 8
    first = await chat(stack.url, messages(0), max_tokens=2)
    holder = await placed_on(stack.database_url, first["id"])
    engine = make_engine(stack.database_url)
    nc = await nats.connect(re.search(r"NATS\s+(nats://\S+)", stack.log()).group(1))

    async def copies() -> list[ReplicationRecord]:
        async with sessionmaker(engine)() as s:
            return list((await s.execute(select(ReplicationRecord))).scalars())

    async def holders() -> dict[str, int]:
        req = KVMatchRequest(block_hashes=hashes)
        reply = await bus.request(nc, subjects.KV_MATCH, req, KVMatchReply, 10)
        return {i: n for i, n in reply.matches.items() if n == len(hashes)}

    try:
        # The next requests must find the prefix indexed on its holder (KV events are
        # asynchronous), or largest_prefix could place one elsewhere by queue.
        assert holder in await until(holders, what="the system prompt in the KV index")
        # Requests on the same system prompt until the conductor orders a copy: each one
        # the KV manager matches is a hit on the prefix, which turns hot within a few.
        ids = []
        for i in range(1, 40):
            ids.append((await chat(stack.url, messages(i), max_tokens=2))["id"])
            if await copies():
                break
        [copy] = (await copies())[:1]
        assert copy.source == holder and copy.target != holder
        assert copy.blocks == len(hashes) and copy.nbytes > 0 and copy.heat_rps >= 0.3
        assert "wants" in copy.reason and copy.holders == 1
        # The copy lands: the index shows the target holding the whole prefix...
        got = await until(lambda: _with(holders(), copy.target), what="the copy in the KV index")
        assert got[holder] == len(hashes)
        # ...though no request was placed there before it was ordered.
        async with sessionmaker(engine)() as s:
            rows = (await s.execute(select(RequestRecord).where(RequestRecord.id.in_(ids)))).all()
        placed = {r[0].prefill_instance for r in rows}
        assert placed == {holder}
    finally:
        await nc.close()
        await engine.dispose()


async def _with(pending, instance_id: str) -> dict[str, int] | None:
    got = await pending
    return got if instance_id in got else None
