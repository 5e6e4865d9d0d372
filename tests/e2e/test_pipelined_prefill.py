"""Pipelined prefill through the whole stack: with groups on (`HALFMOON_MAX_STAGES=2`), a
long prompt goes to both prefill instances at once, each running half the layers, and the
answer is transformers' own greedy answer, token for token. The conductor's decision
record says it chose the group; a short prompt still goes to one instance."""

from __future__ import annotations

import json

import aiohttp
import pytest
import torch
from sqlalchemy import select

from shared.db.schema import DecisionRecord
from shared.db.session import make_engine, sessionmaker
from shared.engine.runner import load_model
from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack
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
    extra = ["--dtype", "float32", "--prefill", "2"]
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


async def test_a_long_prompt_runs_on_a_group_and_answers_as_transformers(
    pipelined_stack, model_dir
):
    long = await complete(pipelined_stack.url, LONG)
    assert long["choices"][0]["text"] == reference(model_dir, LONG)
    assert long["usage"]["prompt_tokens"] > 512
    stages = await stages_of(pipelined_stack.database_url, long["id"])
    assert stages is not None and [s["layers"] for s in stages] == [[0, 15], [15, 30]]
    assert len({s["instance"] for s in stages}) == 2
    short = await complete(pipelined_stack.url, "The capital of France is")
    assert await stages_of(pipelined_stack.database_url, short["id"]) is None
