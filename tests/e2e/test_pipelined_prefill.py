"""Pipelined prefill through the whole stack: with groups on (`HALFMOON_MAX_STAGES=2`), a
long prompt goes to both prefill instances at once, each running half the layers, and the
answer is transformers' own greedy answer, token for token. The conductor's decision
record says it chose the group; the same prompt again goes to the same group, which holds
its prefix (published under the group's holder id); a short prompt goes to one instance."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import aiohttp
import nats
import pytest
import torch
from sqlalchemy import select

from shared import bus, subjects
from shared.db.schema import DecisionRecord
from shared.db.session import make_engine, sessionmaker
from shared.engine.runner import load_model
from shared.groups import group_holder
from shared.hashing import block_hashes
from shared.kv_messages import KVMatchReply, KVMatchRequest
from tests.conftest import make_database
from tests.e2e.conftest import children_of, start_stack, stop_stack
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
LONG = "The river bends past the mill, the bridge and the old church. " * 50  # ~700 tokens
TOKENS = 12


@pytest.fixture
def pipelined_stack(tmp_path, model_dir):
    url, _ = make_database("sqlite", tmp_path)
    env = {
        "HALFMOON_MAX_STAGES": "2",
        "HALFMOON_PIPELINE_MIN_TOKENS": "512",
        "HALFMOON_CHUNK_TOKENS": "128",  # several chunks, so the stages overlap
    }
    # Each engine pinned to one core of its own, as a group's stages should be.
    extra = ["--dtype", "float32", "--prefill", "2", "--threads", "1", "--pin-engines"]
    stack = start_stack(tmp_path, model_dir, url, extra, env=env)
    yield stack
    assert stop_stack(stack) == 0


async def complete(url: str, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


def reference(model_dir, prompt: str) -> str:
    lm = load_model(model_dir, "float32")
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = lm.model.generate(ids, max_new_tokens=TOKENS, do_sample=False)
    return lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


async def stages_of(database_url: str, request_id: str) -> list | None:
    """The stages of the candidate the conductor chose for the request (None: one instance)."""
    engine = make_engine(database_url)

    async def record() -> DecisionRecord | None:
        async with sessionmaker(engine)() as s:
            return (
                await s.execute(
                    select(DecisionRecord).where(DecisionRecord.request_id == request_id)
                )
            ).scalar_one_or_none()

    try:
        row = await until(record, what=f"the decision on {request_id}")
    finally:
        await engine.dispose()
    candidates = row.candidates if isinstance(row.candidates, list) else json.loads(row.candidates)
    chosen = min(candidates, key=lambda c: abs(c["ttft_ms"] - row.predicted_ttft_ms))
    return chosen.get("stages")


async def group_holds(stack, model_dir, prompt: str) -> str:
    """Until the KV manager credits a group with every full block of `prompt`; its id."""
    ids = load_model(model_dir, "float32").tokenizer(prompt).input_ids
    hashes = block_hashes(ids, 16)
    nc = await nats.connect(re.search(r"NATS\s+(nats://\S+)", stack.log()).group(1))

    async def holder() -> str | None:
        reply = await bus.request(
            nc, subjects.KV_MATCH, KVMatchRequest(block_hashes=hashes), KVMatchReply, 10
        )
        held = reply.matches.items()
        return next((i for i, n in held if i.startswith("group:") and n == len(hashes)), None)

    try:
        return await until(holder, what="the prompt's blocks under a group's id")
    finally:
        await nc.close()


def pinned(stack) -> dict[str, set[int]]:
    """The CPUs each engine process of the stack may run on, by instance id."""
    out = {}
    for pid in children_of(stack.proc.pid):
        args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        if "--instance-id" in args and "--cpus" in args:
            out[args[args.index("--instance-id") + 1]] = os.sched_getaffinity(pid)
    return out


async def test_a_long_prompt_runs_on_a_group_and_answers_as_transformers(
    pipelined_stack, model_dir
):
    cores = sorted(os.sched_getaffinity(0))
    assert pinned(pipelined_stack) == {
        "prefill-0": {cores[0]},
        "prefill-1": {cores[1 % len(cores)]},
        "decode-0": {cores[2 % len(cores)]},
    }
    long = await complete(pipelined_stack.url, LONG)
    assert long["choices"][0]["text"] == reference(model_dir, LONG)
    assert long["usage"]["prompt_tokens"] > 512
    stages = await stages_of(pipelined_stack.database_url, long["id"])
    assert stages is not None and [s["layers"] for s in stages] == [[0, 15], [15, 30]]
    assert len({s["instance"] for s in stages}) == 2
    holder = await group_holds(pipelined_stack, model_dir, LONG)
    again = await complete(pipelined_stack.url, LONG)  # the group's prefix, reused
    assert again["choices"][0]["text"] == long["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 512
    reused = await stages_of(pipelined_stack.database_url, again["id"])
    assert reused is not None and [s["instance"] for s in reused] == [s["instance"] for s in stages]
    assert holder == group_holder([(s["instance"], tuple(s["layers"])) for s in stages])
    short = await complete(pipelined_stack.url, "The capital of France is")
    assert await stages_of(pipelined_stack.database_url, short["id"]) is None
