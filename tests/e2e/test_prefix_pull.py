"""Cross-instance reuse: a conversation's second turn, placed on the other prefill
instance because the first one is busy, pulls its prefix blocks from the first instead of
recomputing them (kvcentric, Algorithm 1: the only policy that pulls).

Turn 2 is sent once the KV manager answers for turn 1's blocks (what the conductor asks
it when placing), and what is left leased is read from heartbeats sent after the request,
not after fixed sleeps."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp
import nats
import pytest
import torch
from sqlalchemy import select

from services.gateway.prompt import PromptBuilder
from shared import bus, subjects
from shared.db.schema import RequestRecord
from shared.db.session import make_engine, sessionmaker
from shared.engine.runner import load_model
from shared.hashing import block_hashes
from shared.kv_messages import KVMatchReply, KVMatchRequest
from tests.conftest import make_database
from tests.e2e.conftest import children_of, start_stack, stop_stack
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
STORY = (
    "The lighthouse keeper wrote in his log every night. He noted the wind, the ships, "
    "the color of the sea and the names of the birds that rested on the rail. "
) * 6
# Seconds of prefill on the holder: its queue makes the pull the fastest way to turn 2.
FILLER = "Another night, another page of the log, and the lamp kept turning. " * 120


async def chat(url: str, messages: list[dict], max_tokens: int = 16) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def placed_on(database_url: str, request_id: str) -> str:
    engine = make_engine(database_url)

    async def prefill_instance() -> str | None:
        async with sessionmaker(engine)() as s:
            row = (
                await s.execute(select(RequestRecord).where(RequestRecord.id == request_id))
            ).scalar_one_or_none()
        return row.prefill_instance if row is not None else None

    try:
        return await until(prefill_instance, what=f"the record of {request_id}")
    finally:
        await engine.dispose()


async def indexed(stack, model_dir: Path, messages: list[dict]) -> str:
    """Wait until the KV manager holds the full blocks of this prompt (all but the last
    will do: that one is recomputed anyway); returns the instance that holds them."""
    ids = PromptBuilder(model_dir, MODEL, 16).tokenize(messages)
    hashes = block_hashes(ids, 16)
    nc = await nats.connect(re.search(r"NATS\s+(nats://\S+)", stack.log()).group(1))

    async def holder() -> str | None:
        reply = await bus.request(
            nc, subjects.KV_MATCH, KVMatchRequest(block_hashes=hashes), KVMatchReply, 10
        )
        return next((i for i, n in reply.matches.items() if n >= len(hashes) - 1), None)

    try:
        return await until(holder, what="the prompt's blocks in the KV index")
    finally:
        await nc.close()


async def heartbeats_after(url: str, t: float, ids: set[str]) -> dict[str, dict]:
    """The instances' heartbeats once each of `ids` has sent one after `t` (wall clock)."""

    async def fresh() -> dict[str, dict] | None:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/admin/state") as resp:
                state = await resp.json()
        got = {i["instance_id"]: i for i in state["instances"]}
        return got if all(i in got and got[i]["sent_at"] > t for i in ids) else None

    return await until(fresh, what=f"heartbeats of {sorted(ids)}", step_s=0.2)


async def idle_now(url: str, instance_id: str) -> None:
    """Until a heartbeat sent from now on says `instance_id` has no prompt to compute. The
    conductor places by what heartbeats say, and the last one sent during a prefill may
    still say busy after it ended."""
    t = time.time()

    async def idle() -> bool:
        state = await heartbeats_after(url, t, {instance_id})
        return not state[instance_id]["queue_prompts"]

    await until(idle, what=f"an idle heartbeat from {instance_id}")


async def wait_busy(url: str, instance_id: str, timeout_s: float = 30.0) -> None:
    """Until `instance_id`'s heartbeat reports a prompt still to compute."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(f"{url}/admin/state") as resp:
                state = await resp.json()
            if any(
                i["instance_id"] == instance_id and i["queue_prompts"] for i in state["instances"]
            ):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{instance_id} never reported work")


@pytest.fixture
def two_prefill_stack(tmp_path, model_dir):
    url, _ = make_database("sqlite", tmp_path)
    stack = start_stack(tmp_path, model_dir, url, ["--dtype", "float32", "--prefill", "2"])
    yield stack
    assert stop_stack(stack) == 0


async def test_second_turn_on_other_instance_pulls_the_prefix(two_prefill_stack, model_dir):
    stack = two_prefill_stack
    turn1 = [{"role": "user", "content": STORY + "What did he write about?"}]
    first = await chat(stack.url, turn1)
    holder = await placed_on(stack.database_url, first["id"])
    assert await indexed(stack, model_dir, turn1) == holder
    await idle_now(stack.url, holder)  # else a stale heartbeat may still show turn 1 running
    # A long prompt that shares turn 1's opening goes to the holder (its own cache is
    # cheapest there) and keeps it busy: turn 2 is then fastest on the idle instance,
    # with the prefix pulled from the holder.
    busy = asyncio.create_task(chat(stack.url, [{"role": "user", "content": STORY + FILLER}], 1))
    await wait_busy(stack.url, holder)
    turn2 = turn1 + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what about the birds?"},
    ]
    second = await chat(stack.url, turn2)
    filler = await busy

    assert await placed_on(stack.database_url, filler["id"]) == holder
    on2 = await placed_on(stack.database_url, second["id"])
    assert on2 != holder, "kvcentric should put turn 2 on the idle instance"
    prompt1 = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prompt1 // 16 * 16 - 16, (cached, prompt1)  # turn 1's blocks came over
    assert "pulled" in stack.log() and "prefix tokens from" in stack.log()

    lm = load_model(model_dir, "float32", threads=1)
    ids = lm.tokenizer.apply_chat_template(turn2, add_generation_prompt=True)["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    cold = lm.tokenizer.decode(out[0][len(ids) :], skip_special_tokens=True)
    assert second["choices"][0]["message"]["content"] == cold


def instance_pid(stack, instance_id: str) -> int:
    """The pid of this stack's process for `instance_id` (other stacks may run beside it)."""
    for pid in children_of(stack.proc.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--instance-id" in args and instance_id.encode() in args:
            return pid
    raise AssertionError(f"no process for {instance_id}")


@pytest.fixture
def kvcentric_stack(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("HALFMOON_TRANSFER_TIMEOUT_S", "3")
    url, _ = make_database("sqlite", tmp_path)
    stack = start_stack(tmp_path, model_dir, url, ["--dtype", "float32", "--prefill", "2"])
    yield stack
    assert stop_stack(stack) == 0


async def test_a_stalled_prefix_holder_means_recompute_not_a_hang(kvcentric_stack, model_dir):
    """The holder of a prefix stops answering (SIGSTOP) just as another instance needs its
    blocks: the placement and the pull time out, the request is recomputed elsewhere and
    completes with the right output, and no block stays held."""
    import os
    import signal

    stack = kvcentric_stack
    turn1 = [{"role": "user", "content": STORY + "What did he write about?"}]
    first = await chat(stack.url, turn1)
    holder = await placed_on(stack.database_url, first["id"])
    assert await indexed(stack, model_dir, turn1) == holder  # placement will want its blocks
    pid = instance_pid(stack, holder)
    os.kill(pid, signal.SIGSTOP)
    try:
        turn2 = turn1 + [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And what about the birds?"},
        ]
        second = await asyncio.wait_for(chat(stack.url, turn2), timeout=60)
        done = time.time()
    finally:
        os.kill(pid, signal.SIGCONT)
    other = await placed_on(stack.database_url, second["id"])
    assert other != holder
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] < 64  # recomputed
    lm = load_model(model_dir, "float32", threads=1)
    ids = lm.tokenizer.apply_chat_template(turn2, add_generation_prompt=True)["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert second["choices"][0]["message"]["content"] == lm.tokenizer.decode(
        out[0][len(ids) :], skip_special_tokens=True
    )
    # Its blocks were freed before its last token went out: heartbeats sent since say so.
    state = await heartbeats_after(stack.url, done, {other, "decode-0"})
    used = {i: state[i]["kv_tokens_used"] for i in (other, "decode-0")}
    assert used[other] == 0 and used["decode-0"] == 0, used  # nothing left leased
