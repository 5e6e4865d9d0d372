"""A chat request through the whole disaggregated path, against transformers itself.

gateway → conductor → prefill → KV handoff (TCP data plane) → decode → gateway, real
processes, real nats-server, real SQL, the real model.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch
from sqlalchemy import select

from shared.db.schema import RequestRecord
from shared.db.session import make_engine, sessionmaker
from shared.engine.runner import load_model
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the moon.",
    "List three prime numbers.",
    "Explain in one sentence what a KV cache is.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers generate, in this process, on the same model and dtype as the stack."""
    lm = load_model(model_dir, "float32", threads=1)

    def generate(prompt: str, max_new_tokens: int) -> str:
        ids = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )["input_ids"]
        with torch.inference_mode():
            out = lm.model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
            )
        new = out[0][len(ids) :].tolist()
        return new, lm.tokenizer.decode(new, skip_special_tokens=True)

    return generate


async def stream_chat(url: str, prompt: str, max_tokens: int) -> tuple[str, list[dict]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict] = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            done = False
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line:
                    continue
                assert line.startswith("data: ")
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunks.append(json.loads(data))
            assert done, "stream did not end with [DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return text, chunks


async def test_streaming_greedy_matches_transformers(stack, reference):
    for prompt in PROMPTS:
        ref_ids, ref_text = reference(prompt, 48)
        text, chunks = await stream_chat(stack.url, prompt, 48)
        assert text == ref_text, f"prompt {prompt!r}"
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == len(ref_ids)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert 0 <= cached < usage["prompt_tokens"]  # the last token is always computed
        expected = "stop" if len(ref_ids) < 48 else "length"
        assert finals[0]["choices"][0]["finish_reason"] == expected


async def test_concurrent_requests_match_transformers(stack, reference):
    """Several requests in flight at once share the decode instance and stay exact."""
    results = await asyncio.gather(*(stream_chat(stack.url, p, 32) for p in PROMPTS))
    for prompt, (text, _) in zip(PROMPTS, results):
        assert text == reference(prompt, 32)[1], f"prompt {prompt!r}"


async def test_non_streaming_with_openai_client(stack, reference):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=24,
        temperature=0,
    )
    ref_ids, ref_text = reference(PROMPTS[0], 24)
    assert resp.choices[0].message.content == ref_text
    assert resp.usage.completion_tokens == len(ref_ids)
    assert resp.usage.prompt_tokens > 20
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()


async def test_every_request_has_one_terminal_record(stack):
    text, chunks = await stream_chat(stack.url, "Say hi.", 8)
    rid = chunks[0]["id"]
    engine = make_engine(stack.database_url)

    async def completed() -> RequestRecord | None:
        async with sessionmaker(engine)() as s:
            row = (
                await s.execute(select(RequestRecord).where(RequestRecord.id == rid))
            ).scalar_one_or_none()
        return row if row is not None and row.status == "completed" else None

    try:  # records are written in batches, off the request path
        row = await until(completed, what=f"the terminal record of {rid}")
        assert row.prefill_instance == "prefill-0" and row.decode_instance == "decode-0"
        assert row.ttft_ms is not None and 0 < row.ttft_ms <= row.e2e_ms
        assert row.completion_tokens >= 1 and row.prompt_tokens > 5
        async with sessionmaker(engine)() as s:
            open_rows = (
                (
                    await s.execute(
                        select(RequestRecord).where(RequestRecord.status.in_(["queued", "running"]))
                    )
                )
                .scalars()
                .all()
            )
        assert open_rows == []
    finally:
        await engine.dispose()


async def test_repeated_prompt_reuses_the_prefix_cache(stack, reference):
    prompt = "Summarize the plot of Romeo and Juliet in two sentences. " * 3
    _, first = await stream_chat(stack.url, prompt, 16)
    text, second = await stream_chat(stack.url, prompt, 16)
    assert text == reference(prompt, 16)[1]  # reuse changes nothing in the output
    prompt_tokens = second[-1]["usage"]["prompt_tokens"]
    cached = second[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    # token-exact: every prompt token but the last comes from the cache (the full blocks,
    # then the first tokens of the block the first request's prompt ended in)
    assert (
        cached == prompt_tokens - 1 > first[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


async def test_admin_shows_hit_rates_and_decisions(stack):
    prompt = "Name three rivers in Europe and one fact about each. " * 4
    await stream_chat(stack.url, prompt, 4)
    _, chunks = await stream_chat(stack.url, prompt, 4)
    rid = chunks[0]["id"]
    async with aiohttp.ClientSession() as http:

        async def terminal() -> dict | None:  # SQL writes are batched: the last one is in
            async with http.get(f"{stack.url}/admin/requests/{rid}") as resp:
                got = await resp.json() if resp.status == 200 else None
            # the decision's record may be written before the request's
            ok = got and got["request"] and got["request"]["status"] == "completed"
            return got if ok else None

        one = await until(terminal, what=f"the terminal record of {rid}")
        async with http.get(f"{stack.url}/admin/kv") as resp:
            kv = await resp.json()
        async with http.get(f"{stack.url}/admin/requests/nope") as resp:
            assert resp.status == 404
    cluster = kv["60s"]["cluster"]
    assert cluster["cached_tokens"] > 0 and 0 < cluster["hit_rate"] < 1
    assert kv["60s"]["instances"]["prefill-0"]["requests"] >= 2
    decision = one["decision"]
    assert decision["policy"] == "kvcentric" and decision["prefill_instance"] == "prefill-0"
    assert decision["candidates"][0]["prefix_blocks"] > 0 and decision["predicted_ttft_ms"] > 0
    assert one["request"]["status"] == "completed"
    # Decode served the same prompt just before: it held the prompt's full blocks, and the
    # handoff moved only the rest (decode-side reuse), which the record tells.
    assert one["request"]["handoff_held_tokens"] >= 16 and one["request"]["handoff_bytes"] > 0


async def test_seeded_sampling_is_reproducible(stack):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 24,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 1234,
    }
    async with aiohttp.ClientSession() as http:
        texts = []
        for _ in range(2):
            async with http.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                texts.append((await resp.json())["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and texts[0]


async def test_stop_string_ends_the_answer(stack, reference):
    _, ref_text = reference(PROMPTS[0], 24)
    stop = ref_text.split()[2]  # a word the greedy answer contains
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 24,
        "temperature": 0,
        "stop": [stop],
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
            data = await resp.json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["choices"][0]["message"]["content"] == ref_text[: ref_text.index(stop)]
