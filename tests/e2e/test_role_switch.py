"""Role switches in place, on a real stack (`halfmoon up`: real NATS, SQL and model, fp32
greedy so outputs compare exactly): under load nothing is lost and no output changes; a
decode instance that switches finishes its sequences first; a switch that would leave a
role empty, or names no instance, is refused with its reason; the planner, in advisory
mode, records complete decisions; and colocated instances, beside prefill and decode
ones, serve whole requests with the same output and switch back."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from sqlalchemy import select, text

from services.tools.instances import role as role_of
from shared.db.schema import RequestRecord
from shared.db.session import make_engine, sessionmaker
from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
TOKENS = 32
PROMPTS = [f"Write about lighthouse number {i} and its keeper." for i in range(8)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("role-switch")
    url, _ = make_database("sqlite", tmp)
    s = start_stack(
        tmp,
        model_dir,
        url,
        ["--dtype", "float32", "--prefill", "2", "--decode", "1", "--planner", "advisory"],
        env={"HALFMOON_PLANNER_INTERVAL_S": "0.5", "HALFMOON_PLANNER_WINDOW_S": "10"},
    )
    yield s
    assert stop_stack(s) == 0


async def generate(
    http: aiohttp.ClientSession, url: str, prompt: str, tokens: int = TOKENS
) -> dict:
    body = {
        "model": MODEL,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        out = await resp.json()
        out["status"], out["id"] = resp.status, resp.headers.get("X-Request-Id", "")
        return out


async def engines(http: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    async with http.get(f"{url}/admin/state") as resp:
        state = await resp.json()
    return {i["instance_id"]: i for i in state["instances"] if i["role"] in ("prefill", "decode")}


async def set_role(http: aiohttp.ClientSession, url: str, instance: str, role: str):
    async with http.post(f"{url}/admin/instances/{instance}/role", json={"role": role}) as r:
        return r.status, await r.json()


async def serving_as(http: aiohttp.ClientSession, url: str, instance: str, role: str) -> None:
    async def done() -> bool:
        i = (await engines(http, url)).get(instance)
        return i is not None and role_of(i) == role and i["status"] == "ready"

    await until(done, timeout_s=120, what=f"{instance} serving as {role}")


async def terminal(database_url: str, ids: list[str]) -> dict[str, str] | None:
    """Each request's status once every one is terminal (None until then)."""
    engine = make_engine(database_url)
    try:
        async with sessionmaker(engine)() as s:
            recs = (
                await s.execute(select(RequestRecord).where(RequestRecord.id.in_(ids)))
            ).scalars()
            statuses = {r.id: r.status for r in recs}
    finally:
        await engine.dispose()
    done = len(statuses) == len(ids) and all(
        v not in ("queued", "running") for v in statuses.values()
    )
    return statuses if done else None


async def rows(database_url: str, sql: str) -> list:
    engine = make_engine(database_url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(text(sql))).mappings())
    finally:
        await engine.dispose()


async def test_switches_under_load_lose_nothing_and_change_no_output(stack):
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        reference = [await generate(http, stack.url, p) for p in PROMPTS[:4]]
        before = await engines(http, stack.url)
        prefills = sorted(i for i, e in before.items() if e["role"] == "prefill")
        decode = next(i for i, e in before.items() if e["role"] == "decode")

        # A prefill instance becomes decode while requests flow.
        load = asyncio.gather(*(generate(http, stack.url, p) for p in PROMPTS))
        status, body = await set_role(http, stack.url, prefills[1], "decode")
        assert status == 202, body
        assert body["from_role"] == "prefill" and body["to_role"] == "decode"
        first = await load
        await serving_as(http, stack.url, prefills[1], "decode")

        # The first decode instance becomes prefill while its batch runs: its sequences
        # finish there before it switches (the stack keeps one of each role throughout).
        # Longer answers, so the batch is still running when the switch arrives; and its
        # heartbeats first say idle, so a batch seen running is this load's.
        async def running_on_decode() -> int:
            return (await engines(http, stack.url))[decode]["running"]

        await until(lambda: _not(running_on_decode()), timeout_s=60, what="the first batch over")
        load = asyncio.gather(*(generate(http, stack.url, p, 4 * TOKENS) for p in PROMPTS))
        await until(running_on_decode, timeout_s=60, what="a batch running on decode")
        status, body = await set_role(http, stack.url, decode, "prefill")
        assert status == 202, body
        second = await load
        await serving_as(http, stack.url, decode, "prefill")

    for tokens, batch in ((TOKENS, first), (4 * TOKENS, second)):
        for got in batch:
            assert got["status"] == 200, got
            assert got["usage"]["completion_tokens"] == tokens
    # Greedy: the same prompt gives the same tokens, however many it is asked for.
    texts = {p: r["choices"][0]["message"]["content"] for p, r in zip(PROMPTS, reference)}
    for batch in (first, second):
        for p, got in zip(PROMPTS, batch):
            if p in texts:
                assert got["choices"][0]["message"]["content"].startswith(texts[p]), p

    # Every request has its one terminal record, completed (records are written behind
    # the responses: wait for them to be terminal, then check what they say).
    ids = [g["id"] for g in first + second]
    statuses = await until(lambda: terminal(stack.database_url, ids), what="terminal records")
    assert statuses == {i: "completed" for i in ids}

    # The switches are on record, with what each drain waited for.
    async def done_switches() -> list:
        got = await rows(
            stack.database_url,
            "select * from role_switches where status = 'done' order by requested_at",
        )
        return got if len(got) >= 2 else []

    switches = await until(done_switches, what="two finished switches on record")
    assert [(s["instance_id"], s["to_role"]) for s in switches][-2:] == [
        (prefills[1], "decode"),
        (decode, "prefill"),
    ]
    assert all(s["drain_s"] is not None and s["source"] == "admin" for s in switches)
    assert "finished" in switches[-1]["detail"] and "running" in switches[-1]["detail"]


async def test_refused_switches_say_why(stack):
    async with aiohttp.ClientSession() as http:
        now = await engines(http, stack.url)
        by_role: dict[str, list[str]] = {"prefill": [], "decode": []}
        for iid, e in sorted(now.items()):
            by_role[e["role"]].append(iid)
        role, (last,) = next((r, ids) for r, ids in by_role.items() if len(ids) == 1)
        other = "decode" if role == "prefill" else "prefill"
        status, body = await set_role(http, stack.url, last, other)
        assert status == 409, body
        assert body["error"]["code"] == "conflict"
        assert f"the last {role} instance" in body["error"]["message"]

        status, body = await set_role(http, stack.url, last, role)
        assert status == 409 and "already" in body["error"]["message"]

        status, body = await set_role(http, stack.url, "no-such-engine", "decode")
        assert status == 404, body

        status, body = await set_role(http, stack.url, last, "mixed")
        assert status == 400 and body["error"]["param"] == "role"
        assert (await engines(http, stack.url))[last]["role"] == role  # nothing moved

    refused = await until(
        lambda: rows(stack.database_url, "select * from role_switches where status='refused'"),
        what="the refusals on record",
    )
    assert any("would leave none" in r["detail"] for r in refused)


async def test_advisory_planner_records_complete_decisions(stack):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(generate(http, stack.url, p) for p in PROMPTS[:4]))
    records = await until(
        lambda: rows(
            stack.database_url,
            "select * from plan_decisions order by created desc limit 20",
        ),
        what="planner decisions on record",
    )
    d = records[0]
    assert d["mode"] == "advisory" and not d["acted"]
    assert d["current_prefill"] + d["current_decode"] >= 2
    assert d["reason"]
    estimates = _json(d["estimates"])
    assert len(estimates) == d["current_prefill"] + d["current_decode"] - 1  # every split
    assert {"prefill", "decode", "goodput_rps", "ttft_s", "tbt_s"} <= set(estimates[0])
    forecast = _json(d["forecast"])
    assert {"rate_per_s", "prompt_tokens", "cached_tokens", "output_tokens"} <= set(forecast)
    instances = _json(d["instances"])
    assert {i["role"] for i in instances} == {"prefill", "decode"}
    assert any(_json(r["forecast"])["rate_per_s"] > 0 for r in records)
    async with aiohttp.ClientSession() as http:  # advisory: it switched nothing itself
        assert len(await engines(http, stack.url)) == 3
    planned = await rows(stack.database_url, "select * from role_switches where source='planner'")
    assert planned == []


async def test_colocated_instances_serve_whole_requests_and_switch_back(stack):
    """Both prefill instances become colocated, one under load: requests then run whole on
    them (no decode instance in their decisions) with unchanged output; the decode
    instance may not leave (prefill instances put back would have none); and a colocated
    instance switched back while its batch runs finishes its sequences first."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        now = await engines(http, stack.url)
        prefills = sorted(i for i, e in now.items() if role_of(e) == "prefill")
        (decode,) = [i for i, e in now.items() if role_of(e) == "decode"]
        reference = [await generate(http, stack.url, p) for p in PROMPTS[:4]]

        load = asyncio.gather(*(generate(http, stack.url, p) for p in PROMPTS))
        status, body = await set_role(http, stack.url, prefills[0], "colocated")
        assert status == 202, body
        assert (body["from_role"], body["to_role"]) == ("prefill", "colocated")
        first = await load
        await serving_as(http, stack.url, prefills[0], "colocated")
        status, body = await set_role(http, stack.url, prefills[1], "colocated")
        assert status == 202, body
        await serving_as(http, stack.url, prefills[1], "colocated")

        status, body = await set_role(http, stack.url, decode, "prefill")
        assert status == 409 and "the last decode instance" in body["error"]["message"]

        whole = await asyncio.gather(*(generate(http, stack.url, p) for p in PROMPTS[:4]))

        # Back to prefill, one while its own batch runs (long answers, so it still runs
        # when the switch arrives): its sequences finish first. Heartbeats first say idle,
        # so a batch seen running is this load's.
        async def running() -> str:
            now = await engines(http, stack.url)
            return next((i for i in prefills if now[i]["running"] >= 2), "")

        await until(lambda: _not(running()), timeout_s=60, what="the last batch over")
        load = asyncio.gather(*(generate(http, stack.url, p, 8 * TOKENS) for p in PROMPTS))
        busy = await until(running, timeout_s=60, what="a colocated batch running")
        status, body = await set_role(http, stack.url, busy, "prefill")
        assert status == 202 and body["from_role"] == "colocated", body
        last = await load
        await serving_as(http, stack.url, busy, "prefill")

    texts = [r["choices"][0]["message"]["content"] for r in reference]
    for got in first + whole + last:
        assert got["status"] == 200, got
    for p, got in zip(PROMPTS, whole):
        assert got["choices"][0]["message"]["content"] == texts[PROMPTS.index(p)], p
    for p, got in zip(PROMPTS[:4], first[:4] + last[:4]):
        assert got["choices"][0]["message"]["content"].startswith(texts[PROMPTS.index(p)])

    ids = [g["id"] for g in first + whole + last]
    statuses = await until(lambda: terminal(stack.database_url, ids), what="terminal records")
    assert statuses == {i: "completed" for i in ids}
    placed = await rows(
        stack.database_url,
        "select request_id, prefill_instance, decode_instance, predicted_tbt_ms from decisions"
        " where request_id in (" + ",".join(f"'{g['id']}'" for g in whole) + ")",
    )
    assert len(placed) == len(whole)
    for d in placed:  # whole on a colocated instance, its own batch's TBT predicted
        assert d["prefill_instance"] in prefills and d["decode_instance"] is None, d
        assert d["predicted_tbt_ms"] > 0

    async def back() -> list:
        got = await rows(
            stack.database_url,
            f"select * from role_switches where instance_id = '{busy}' and status = 'done'"
            " order by requested_at",
        )
        return got if got and got[-1]["to_role"] == "prefill" else []

    switch = (await until(back, what="the switch back on record"))[-1]
    assert switch["from_role"] == "colocated"
    held = re.search(r"finished \d+ requests \((\d+) running", switch["detail"])
    assert held and int(held[1]) > 0, switch  # it drained its own batch


def _json(v):
    return json.loads(v) if isinstance(v, str) else v


async def _not(value) -> bool:
    return not await value
