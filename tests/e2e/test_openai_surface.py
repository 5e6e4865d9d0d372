"""The OpenAI surface on the real stack, item by item: text completions with echo and
prompt logprobs (against transformers), n > 1, the sampling parameters, the first SSE
chunk, null fields, X-Request-Id, the small endpoints, and a non-streaming request whose
client leaves."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import torch

from shared.engine.runner import load_model
from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("surface")
    url, _ = make_database("sqlite", tmp)
    s = start_stack(tmp, model_dir, url, ["--dtype", "float32"])
    yield s
    assert stop_stack(s) == 0


@pytest.fixture(scope="module")
def lm(model_dir):
    return load_model(model_dir, "float32", threads=1)


async def post(
    url: str, path: str, body: dict, headers: dict | None = None
) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async with http.post(f"{url}{path}", json=body, headers=headers) as resp:
            return resp.status, resp.headers.copy(), await resp.json()


async def sse(url: str, path: str, body: dict) -> list[tuple[float, dict]]:
    """(arrival time, chunk) of each event, [DONE] excluded."""
    out = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}{path}", json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    out.append((time.monotonic(), json.loads(line[6:])))
    return out


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def test_echo_logprobs_score_the_prompt_like_transformers_cached_or_not(stack, lm):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several full blocks
    ids = lm.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
    want = [float(ref[i - 1, t]) for i, t in enumerate(ids) if i > 0]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    for attempt in range(2):  # the second is served from the prefix cache
        status, _, data = await post(stack.url, "/v1/completions", body)
        assert status == 200, data
        choice = data["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][1 : len(ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, attempt
        assert len(lp["tokens"]) == len(ids) + 1
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    status, _, data = await post(stack.url, "/v1/completions", {**body, "max_tokens": 0})
    assert status == 200 and data["choices"][0]["text"] == prompt
    assert data["usage"]["completion_tokens"] == 0
    assert len(data["choices"][0]["logprobs"]["tokens"]) == len(ids)


async def test_completion_prompts_as_token_ids_and_streamed_echo(stack, lm):
    ids = lm.tokenizer("Hello, my name is")["input_ids"]
    status, _, data = await post(
        stack.url,
        "/v1/completions",
        {"model": MODEL, "prompt": [ids, ids], "max_tokens": 4, "temperature": 0},
    )
    assert status == 200 and [c["index"] for c in data["choices"]] == [0, 1]
    assert data["choices"][0]["text"] == data["choices"][1]["text"]
    assert data["usage"]["prompt_tokens"] == 2 * len(ids)
    events = await sse(
        stack.url,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Hello, my name is",
            "max_tokens": 4,
            "temperature": 0,
            "echo": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [c for _, c in events]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "Hello, my name is" + data["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []


async def test_the_role_chunk_comes_with_the_first_token(stack):
    events = await sse(
        stack.url, "/v1/chat/completions", chat("Say something long.", max_tokens=12, temperature=0)
    )
    first = events[0][1]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"]  # a token's text, not ""
    assert sum("role" in c["choices"][0]["delta"] for _, c in events if c["choices"]) == 1


async def test_n_samples_are_indexed_and_counted(stack):
    status, _, one = await post(
        stack.url, "/v1/chat/completions", chat("Hi!", max_tokens=8, temperature=0, ignore_eos=True)
    )
    status, _, three = await post(
        stack.url, "/v1/chat/completions", chat("Hi!", max_tokens=8, n=3, seed=7, ignore_eos=True)
    )
    assert status == 200 and [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["usage"]["completion_tokens"] == 24
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    again = (
        await post(
            stack.url,
            "/v1/chat/completions",
            chat("Hi!", max_tokens=8, n=3, seed=7, ignore_eos=True),
        )
    )[2]
    assert [c["message"]["content"] for c in again["choices"]] == [
        c["message"]["content"] for c in three["choices"]
    ]  # seed + i per choice


async def test_sampling_parameters_take_effect(stack, lm):
    tok = lm.tokenizer
    target = tok(" banana")["input_ids"][0]
    status, _, data = await post(
        stack.url,
        "/v1/chat/completions",
        chat("Hi", max_tokens=3, temperature=0, logit_bias={str(target): 100}),
    )
    assert status == 200 and data["choices"][0]["message"]["content"] == " banana" * 3
    free = (
        await post(stack.url, "/v1/chat/completions", chat("Say OK.", max_tokens=40, temperature=0))
    )[2]
    natural = free["usage"]["completion_tokens"]
    longer = (
        await post(
            stack.url,
            "/v1/chat/completions",
            chat("Say OK.", max_tokens=natural + 10, temperature=0, min_tokens=natural + 5),
        )
    )[2]
    assert longer["usage"]["completion_tokens"] >= natural + 5
    first = tok(free["choices"][0]["message"]["content"])["input_ids"][1]
    stopped = (
        await post(
            stack.url,
            "/v1/chat/completions",
            chat("Say OK.", max_tokens=40, temperature=0, stop_token_ids=[first]),
        )
    )[2]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 2
    for extra in (
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.5},
        {"repetition_penalty": 1.3},
        {"min_p": 0.2},
        {"top_k": -1},
        {
            "temperature": None,
            "top_p": None,
            "n": None,
            "stream": None,
            "max_tokens": None,
            "stop": None,
            "seed": None,
        },
    ):
        status, _, data = await post(
            stack.url,
            "/v1/chat/completions",
            chat("Write a list of fruits.", **{"max_tokens": 12, **extra}),
        )
        assert status == 200, (extra, data)


async def test_x_request_id_is_used_echoed_and_never_reused(stack):
    status, headers, data = await post(
        stack.url, "/v1/chat/completions", chat("Hi", max_tokens=2), {"X-Request-Id": "trace-42"}
    )
    assert status == 200, data
    assert headers["X-Request-Id"] == "trace-42" and data["id"] == "trace-42"

    async def recorded():
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.url}/admin/requests/trace-42") as resp:
                return resp.status == 200 and (await resp.json())["request"]

    await until(recorded, what="the record of trace-42")
    status, headers, data = await post(
        stack.url, "/v1/chat/completions", chat("Hi", max_tokens=2), {"X-Request-Id": "trace-42"}
    )
    assert status == 200 and headers["X-Request-Id"].startswith("chatcmpl-")  # a fresh one
    assert data["id"] == headers["X-Request-Id"]
    status, headers, _ = await post(
        stack.url, "/v1/chat/completions", chat("Hi", max_tokens=2), {"X-Request-Id": "bad id!"}
    )
    assert status == 200 and headers["X-Request-Id"].startswith("chatcmpl-")
    status, headers, _ = await post(
        stack.url, "/v1/chat/completions", {"bad": 1}, {"X-Request-Id": "err-7"}
    )
    assert status == 400 and headers["X-Request-Id"] == "err-7"


async def test_models_tokenize_detokenize_version(stack, lm):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/v1/models/{MODEL}") as resp:
            card = await resp.json()
        assert card["id"] == MODEL and card["max_model_len"] == 8192
        async with http.get(f"{stack.url}/v1/models/gpt-9") as resp:
            assert resp.status == 404
        async with http.get(f"{stack.url}/version") as resp:
            assert (await resp.json())["version"]
    status, _, got = await post(
        stack.url, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}
    )
    assert got["tokens"] == lm.tokenizer("Hello world")["input_ids"]
    assert got["token_strs"] == ["Hello", " world"] and got["count"] == 2
    status, _, back = await post(stack.url, "/detokenize", {"tokens": got["tokens"]})
    assert back["prompt"] == "Hello world"
    status, _, chat_ids = await post(
        stack.url, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}
    )
    status, _, served = await post(stack.url, "/v1/chat/completions", chat("Hi", max_tokens=1))
    assert chat_ids["count"] == served["usage"]["prompt_tokens"]


async def test_a_non_streaming_client_that_leaves_is_cancelled_everywhere(stack):
    body = chat("Write a very long story.", max_tokens=2000, ignore_eos=True)
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(
            http.post(
                f"{stack.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "leaver-1"}
            )
        )

        async def decoding():  # placed, and the decode instance has it in its batch
            async with http.get(f"{stack.url}/admin/requests/leaver-1") as resp:
                got = await resp.json() if resp.status == 200 else None
            if not got or got["request"]["status"] != "running":
                return False
            async with http.get(f"{stack.url}/admin/state") as resp:
                state = await resp.json()
            return any(i["role"] == "decode" and i["running"] for i in state["instances"])

        await until(decoding, what="leaver-1 is decoding")
        task.cancel()  # the client goes away mid-request
        left = time.time()

        async def cancelled():
            async with http.get(f"{stack.url}/admin/requests/leaver-1") as resp:
                row = (await resp.json())["request"]
            return row if row["status"] == "cancelled" else None

        row = await until(cancelled, what="leaver-1 cancelled")
        assert row["completion_tokens"] < 2000

        async def idle():
            async with http.get(f"{stack.url}/admin/state") as resp:
                state = await resp.json()
            engines = [i for i in state["instances"] if i["role"] in ("prefill", "decode")]
            return state["in_flight"] == 0 and all(
                i["running"] == 0 and i["sent_at"] > left + 1 for i in engines
            )

        await until(idle, what="the engines hold nothing of it")
    assert "request leaver-1: client went away, cancelling" in stack.log()
