"""Clients nobody on this project wrote, against the real stack: the official openai SDK
(sync and async) for chat, completions, streaming, logprobs, n=3, structured output with
`chat.completions.parse`, and a tool-call round trip; and guidellm, a benchmark client
from PyPI, driving both endpoints, whose TTFT must agree with the gateway's own."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import jsonschema
import pytest
from pydantic import BaseModel, Field

from services.tools.bench.schemas import SCHEMAS
from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("clients")
    url, _ = make_database("sqlite", tmp)
    s = start_stack(tmp, model_dir, url, ["--dtype", "float32"])
    yield s
    assert stop_stack(s) == 0


@pytest.fixture(scope="module")
def clients(stack):
    from openai import AsyncOpenAI, OpenAI

    base = f"{stack.url}/v1"
    return OpenAI(base_url=base, api_key="unused", max_retries=0), AsyncOpenAI(
        base_url=base, api_key="unused", max_retries=0
    )


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_sync_chat_stream_completions_and_logprobs(clients):
    sync, _ = clients
    chat = sync.chat.completions.create(
        model=MODEL,
        messages=ask("What is 2+2?"),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = chat.choices[0]
    entries = choice.logprobs.content
    assert choice.message.content and len(entries) == chat.usage.completion_tokens - (
        choice.finish_reason == "stop"
    )  # the end-of-turn token has no entry
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-5
        assert e.logprob <= 0 and bytes(e.bytes).decode() == e.token
    parts = [
        c.choices[0].delta.content or ""
        for c in sync.chat.completions.create(
            model=MODEL, messages=ask("What is 2+2?"), max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(parts) == choice.message.content
    text = sync.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = text.choices[0].logprobs
    assert text.choices[0].text and len(lp.tokens) == len(lp.token_logprobs) == 6
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    streamed = "".join(
        c.choices[0].text
        for c in sync.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text.choices[0].text


async def test_async_n3_streamed_and_whole(clients):
    _, aclient = clients
    whole = await aclient.chat.completions.create(
        model=MODEL, messages=ask("Name a color."), max_tokens=6, n=3, seed=5
    )
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    one = await aclient.chat.completions.create(
        model=MODEL, messages=ask("Name a color."), max_tokens=6, n=1
    )
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert 3 <= whole.usage.completion_tokens <= 3 * 6  # every choice's tokens
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=ask("Name a color."),
        max_tokens=6,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert sorted(finished) == [0, 1, 2] and usage is not None
    assert usage.completion_tokens >= 3
    batch = await aclient.completions.create(
        model=MODEL, prompt=["Once upon", "Hello"], max_tokens=4, n=2, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: the same prompt alike


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


def test_parse_with_a_pydantic_model(clients):
    sync, _ = clients
    got = sync.chat.completions.parse(
        model=MODEL,
        messages=ask("Describe Paris as JSON."),
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    city = got.choices[0].message.parsed
    assert isinstance(city, City) and city.name


async def test_a_tool_call_round_trip(clients):
    _, aclient = clients
    messages = ask("What is the weather in Paris?")
    first = await aclient.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert "city" in json.loads(call.function.arguments)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = await aclient.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=30, temperature=0
    )
    assert second.choices[0].message.content and second.choices[0].finish_reason in (
        "stop",
        "length",
        "tool_calls",
    )
    # Streamed, a named call comes as tool_calls deltas the SDK puts back together.
    chunks = [
        c
        async for c in await aclient.chat.completions.create(
            model=MODEL,
            messages=ask("Weather in Rome?"),
            tools=[WEATHER],
            stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
        )
    ]
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert "city" in json.loads(args)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


QUESTIONS = [
    "Tell me about a person.",
    "Pick a color.",
    "Count something.",
    "Say hi.",
    "Describe the sea.",
]


async def test_20_json_schema_requests_always_validate(clients):
    _, aclient = clients
    for i in range(20):
        schema = SCHEMAS[i % len(SCHEMAS)]
        resp = await aclient.chat.completions.create(
            model=MODEL,
            messages=ask(QUESTIONS[i % len(QUESTIONS)]),
            max_tokens=120,
            temperature=1.0,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema},
            },
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_and_json_object_extensions(clients):
    sync, _ = clients
    out = sync.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=20,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    )
    assert __import__("re").fullmatch(r"[0-9]{3}-[0-9]{4}", out.choices[0].text)
    out = sync.chat.completions.create(
        model=MODEL,
        messages=ask("Is the sky blue?"),
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert out.choices[0].message.content in ("yes", "no")
    out = sync.chat.completions.create(
        model=MODEL,
        messages=ask("A JSON object, please."),
        max_tokens=60,
        response_format={"type": "json_object"},
        temperature=0,
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("halfmoon_ttft_seconds_")
    }


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_drives_both_endpoints_and_agrees_on_ttft(stack, model_dir, tmp_path, endpoint):
    n = 12
    before = scrape(stack.url)
    out = tmp_path / "guidellm.json"
    cmd = [
        str(Path(sys.executable).with_name("guidellm")),
        "run",
        "--backend",
        f"kind=openai_http,target={stack.url},model={MODEL},request_format={endpoint}",
        "--profile",
        "kind=concurrent,streams=2",
        "--constraint",
        f"kind=max_requests,count={n}",
        "--data",
        "kind=synthetic_text,prompt_tokens=128,output_tokens=16",
        "--tokenizer",
        f"kind=hf_auto,model={model_dir}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    done = bench["requests"]["successful"]
    assert len(done) == n and not bench["requests"]["errored"], bench["requests"]["errored"]
    assert all(r["output_tokens"] == 16 for r in done)
    after = scrape(stack.url)
    count = after["halfmoon_ttft_seconds_count"] - before["halfmoon_ttft_seconds_count"]
    assert count == n
    gateway_ms = (
        (after["halfmoon_ttft_seconds_sum"] - before["halfmoon_ttft_seconds_sum"]) / count * 1e3
    )
    client_ms = sum(r["time_to_first_token_ms"] for r in done) / n
    assert math.isclose(client_ms, gateway_ms, rel_tol=0.10), (client_ms, gateway_ms)


async def test_the_stack_logged_no_unhandled_error(stack):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/health") as resp:
            assert resp.status == 200
    assert "unhandled error" not in stack.log() and "engine step failed" not in stack.log()
