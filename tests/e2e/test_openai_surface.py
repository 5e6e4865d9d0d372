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


async def completed(url: str, rid: str) -> dict | None:
    """/admin/requests/{rid} once its request record is completed, else None."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/admin/requests/{rid}") as resp:
            got = await resp.json() if resp.status == 200 else None
    return got if got and got["request"] and got["request"]["status"] == "completed" else None


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


async def test_streamed_logprobs_are_the_whole_ones_up_to_20_alternatives(stack):
    """Chat (top_logprobs 20, the most) and completions (logprobs 5): the streamed
    chunks carry, token by token, what the whole response carries."""
    body = chat("Name three colours.", max_tokens=6, temperature=0, logprobs=True, top_logprobs=20)
    status, _, whole = await post(stack.url, "/v1/chat/completions", body)
    assert status == 200, whole
    want = whole["choices"][0]["logprobs"]["content"]
    assert len(want) == 6 and all(len(t["top_logprobs"]) == 20 for t in want)
    assert all(t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][-1]["logprob"] for t in want)
    streamed = [
        t
        for _, c in await sse(stack.url, "/v1/chat/completions", body)
        if c["choices"] and c["choices"][0].get("logprobs")
        for t in c["choices"][0]["logprobs"]["content"]
    ]
    assert [t["token"] for t in streamed] == [t["token"] for t in want]
    for a, b in zip(streamed, want):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert [x["token"] for x in a["top_logprobs"]] == [x["token"] for x in b["top_logprobs"]]

    text = {"model": MODEL, "prompt": "Red, green and", "max_tokens": 5, "temperature": 0}
    status, _, whole = await post(stack.url, "/v1/completions", {**text, "logprobs": 5})
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and all(len(t) == 5 for t in lp["top_logprobs"])
    chunks = [c for _, c in await sse(stack.url, "/v1/completions", {**text, "logprobs": 5})]
    got = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert [t for g in got for t in g["tokens"]] == lp["tokens"]
    assert [t for g in got for t in g["token_logprobs"]] == pytest.approx(
        lp["token_logprobs"], abs=1e-4
    )


async def test_completions_take_the_chat_path_placement_records_and_slo(stack):
    """A text completion is placed by the conductor like a chat: prefilled on the prefill
    instance, decoded on the decode instance, recorded, and refused early with a 429 when
    its own TTFT SLO cannot be met."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    status, _, data = await post(stack.url, "/v1/completions", body, {"X-Request-Id": "text-1"})
    assert status == 200, data

    got = await until(lambda: completed(stack.url, "text-1"), what="text-1's record")
    rec, dec = got["request"], got["decision"]
    assert rec["prefill_instance"].startswith("prefill") and rec["decode_instance"].startswith(
        "decode"
    )
    assert (dec["prefill_instance"], dec["decode_instance"]) == (
        rec["prefill_instance"],
        rec["decode_instance"],
    )
    assert rec["completion_tokens"] == data["usage"]["completion_tokens"] == 4
    status, _, data = await post(
        stack.url, "/v1/completions", {**body, "ttft_slo_ms": 0.001}, {"X-Request-Id": "text-2"}
    )
    assert status == 429 and data["error"]["code"] == "slo_unattainable", data


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


async def test_n_samples_of_a_fresh_prompt_compute_it_once(stack):
    """One prefill, n decodes: the first choice computes the prompt, the others follow it
    to its prefill instance and start from its blocks (their records say so)."""
    prompt = "Count the stars over the sea, one by one: " + " ".join(str(i) for i in range(60))
    body = chat(prompt, max_tokens=4, n=3, seed=1, ignore_eos=True)
    status, _, data = await post(
        stack.url, "/v1/chat/completions", body, {"X-Request-Id": "samples-1"}
    )
    assert status == 200, data
    prompt_tokens = data["usage"]["prompt_tokens"]
    cacheable = (prompt_tokens - 1) // 16 * 16  # full blocks, the last token computed
    assert cacheable >= 64

    async def records():
        got = [await completed(stack.url, f"samples-1-{k}") for k in range(3)]
        return [g["request"] for g in got] if all(got) else None

    first, *others = await until(records, what="the three choices' records")
    # A fresh prompt (past the chat template's header, which earlier chats cached) is
    # computed by the first choice,
    assert first["cached_tokens"] < cacheable // 2
    for rec in others:  # and only by it
        assert rec["prefill_instance"] == first["prefill_instance"]
        # its full blocks, and the block the prompt ends in if the first had let it go
        assert cacheable <= rec["cached_tokens"] <= prompt_tokens - 1
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == first["cached_tokens"]


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


async def test_penalties_and_min_p_change_what_is_sampled(stack):
    """Past a 200: the penalties break or bend a greedy loop of one repeated sentence, and min_p 1
    (only tokens as likely as the likeliest) or top_k 1 make a hot, seeded sample greedy."""
    body = {"model": MODEL, "prompt": "The cat." * 4, "max_tokens": 18, "ignore_eos": True}

    async def text(**extra) -> str:
        status, _, data = await post(
            stack.url, "/v1/completions", {**body, "temperature": 0, **extra}
        )
        assert status == 200, (extra, data)
        return data["choices"][0]["text"]

    greedy = await text()
    loops = greedy.count("cat")
    assert loops >= 5, greedy  # the loop: " The cat." again and again
    for extra in ({"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        got = await text(**extra)
        assert got.count("cat") < loops, (extra, got)
    # presence_penalty's flat 2 (OpenAI's maximum) is less than this loop's margin, but it
    # still moves what follows the penalized tokens
    assert await text(presence_penalty=2.0) != greedy
    for extra in ({"min_p": 1.0}, {"top_k": 1}):
        assert await text(**{"temperature": 1.5, "seed": 3, **extra}) == greedy, extra
    assert await text(temperature=1.5, seed=3, top_k=-1) != greedy  # -1: no top-k at all


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


LEAVERS = {  # endpoint -> (path, body)
    "chat": (
        "/v1/chat/completions",
        chat("Write a very long story.", max_tokens=2000, ignore_eos=True),
    ),
    "completions": (
        "/v1/completions",
        {"model": MODEL, "prompt": "A very long story:", "max_tokens": 2000, "ignore_eos": True},
    ),
}


@pytest.mark.parametrize("endpoint", list(LEAVERS))
async def test_a_non_streaming_client_that_leaves_is_cancelled_everywhere(stack, endpoint):
    rid, (path, body) = f"leaver-{endpoint}", LEAVERS[endpoint]
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(
            http.post(f"{stack.url}{path}", json=body, headers={"X-Request-Id": rid})
        )

        async def decoding():  # placed, and the decode instance has it in its batch
            async with http.get(f"{stack.url}/admin/requests/{rid}") as resp:
                got = await resp.json() if resp.status == 200 else None
            # the decision's record may be written before the request's
            if not got or not got["request"] or got["request"]["status"] != "running":
                return False
            async with http.get(f"{stack.url}/admin/state") as resp:
                state = await resp.json()
            return any(i["role"] == "decode" and i["running"] for i in state["instances"])

        await until(decoding, what=f"{rid} is decoding")
        task.cancel()  # the client goes away mid-request
        left = time.time()

        async def cancelled():
            async with http.get(f"{stack.url}/admin/requests/{rid}") as resp:
                row = (await resp.json())["request"]
            return row if row["status"] == "cancelled" else None

        row = await until(cancelled, what=f"{rid} cancelled")
        assert row["completion_tokens"] < 2000

        async def idle():
            async with http.get(f"{stack.url}/admin/state") as resp:
                state = await resp.json()
            engines = [i for i in state["instances"] if i["role"] in ("prefill", "decode")]
            return state["in_flight"] == 0 and all(
                i["running"] == 0 and i["sent_at"] > left + 1 for i in engines
            )

        await until(idle, what="the engines hold nothing of it")
    assert f"request {rid}: client went away, cancelling" in stack.log()
