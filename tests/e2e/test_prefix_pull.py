"""Cross-instance reuse: a conversation's second turn, placed on the other prefill
instance because the first one is busy, pulls its prefix blocks from the first instead of
recomputing them (kvcentric, Algorithm 1: the only policy that pulls)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import torch
from sqlalchemy import select

from shared.db.schema import RequestRecord
from shared.db.session import make_engine, sessionmaker
from shared.engine.runner import load_model
from tests.conftest import make_database
from tests.e2e.conftest import children_of, start_stack, stop_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
STORY = ("The lighthouse keeper wrote in his log every night. He noted the wind, the ships, "
         "the color of the sea and the names of the birds that rested on the rail. ") * 6
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
    try:
        for _ in range(50):
            async with sessionmaker(engine)() as s:
                row = (await s.execute(select(RequestRecord).where(
                    RequestRecord.id == request_id))).scalar_one_or_none()
            if row is not None and row.prefill_instance:
                return row.prefill_instance
            await asyncio.sleep(0.1)
    finally:
        await engine.dispose()
    raise AssertionError(f"no record for {request_id}")


async def wait_busy(url: str, instance_id: str, timeout_s: float = 30.0) -> None:
    """Until `instance_id`'s heartbeat reports a prompt still to compute."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(f"{url}/admin/state") as resp:
                state = await resp.json()
            if any(i["instance_id"] == instance_id and i["queue_prompts"]
                   for i in state["instances"]):
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
    await asyncio.sleep(0.5)  # the KV manager indexes turn 1's blocks
    # A long prompt that shares turn 1's opening goes to the holder (its own cache is
    # cheapest there) and keeps it busy: turn 2 is then fastest on the idle instance,
    # with the prefix pulled from the holder.
    busy = asyncio.create_task(chat(stack.url, [{"role": "user", "content": STORY + FILLER}], 1))
    await wait_busy(stack.url, holder)
    turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And what about the birds?"}]
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
    cold = lm.tokenizer.decode(out[0][len(ids):], skip_special_tokens=True)
    assert second["choices"][0]["message"]["content"] == cold


def instance_pid(stack, instance_id: str) -> int:
    """The pid of this stack's process for `instance_id` (other stacks may run beside it)."""
    from pathlib import Path

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
    await asyncio.sleep(0.5)
    pid = instance_pid(stack, holder)
    os.kill(pid, signal.SIGSTOP)
    try:
        turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And what about the birds?"}]
        second = await asyncio.wait_for(chat(stack.url, turn2), timeout=60)
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
        out[0][len(ids):], skip_special_tokens=True)
    await asyncio.sleep(1.5)  # a heartbeat after the request
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/admin/state") as resp:
            state = await resp.json()
    used = {i["instance_id"]: i["kv_tokens_used"] for i in state["instances"]
            if i["role"] in ("prefill", "decode")}
    assert used[other] == 0 and used["decode-0"] == 0, used  # nothing left leased
