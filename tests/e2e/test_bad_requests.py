"""Bad input gets a 4xx with an OpenAI-style error body: never a 500, never a hang."""

from __future__ import annotations

import aiohttp
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MODEL = "SmolLM2-135M-Instruct"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def with_(**changes):
    body = dict(GOOD)
    for k, v in changes.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return body


CASES = {
    "malformed json": (b'{"model": ', 400, "invalid_request"),
    "not an object": ([1, 2], 400, "invalid_request"),
    "missing model": (with_(model=None), 400, "invalid_request"),
    "missing messages": (with_(messages=None), 400, "invalid_request"),
    "messages wrong type": (with_(messages="hello"), 400, "invalid_request"),
    "empty messages": (with_(messages=[]), 400, "invalid_request"),
    "empty content": (with_(messages=[{"role": "user", "content": ""}]), 400, "invalid_request"),
    "unknown role": (with_(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_request"),
    "max_tokens string": (with_(max_tokens="5"), 400, "invalid_request"),
    "max_tokens zero": (with_(max_tokens=0), 400, "invalid_request"),
    "max_tokens negative": (with_(max_tokens=-3), 400, "invalid_request"),
    "max_tokens over context": (with_(max_tokens=10_000), 400, "context_length_exceeded"),
    "temperature out of range": (with_(temperature=5), 400, "invalid_request"),
    "temperature wrong type": (with_(temperature="hot"), 400, "invalid_request"),
    "n above the server's cap": (with_(n=17), 400, "integer_above_max_value"),
    "n zero": (with_(n=0), 400, "invalid_request"),
    "unknown parameter": (with_(frobnicate=1), 400, "unknown_parameter"),
    "unsupported parameter": (with_(audio={"voice": "alloy"}), 400, "unsupported_parameter"),
    "lone surrogate": (
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "invalid_request",
    ),
    "top_logprobs without logprobs": (with_(top_logprobs=2), 400, "invalid_request"),
    "top_logprobs above 20": (with_(logprobs=True, top_logprobs=21), 400, "invalid_request"),
    "logit_bias not a token id": (with_(logit_bias={"x": 1}), 400, "invalid_request"),
    "logit_bias outside the vocabulary": (with_(logit_bias={"999999": 1}), 400, "invalid_request"),
    "invalid regex": (with_(guided_regex="(?=a)b"), 400, "invalid_grammar"),
    "invalid grammar": (with_(guided_grammar="start: ("), 400, "invalid_grammar"),
    "two constraints": (with_(guided_regex="a+", guided_choice=["a"]), 400, "invalid_request"),
    "tool_choice without tools": (with_(tool_choice="required"), 400, "invalid_request"),
    "image content": (
        with_(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        ),
        400,
        "invalid_request",
    ),
    "stream wrong type": (with_(stream="yes"), 400, "invalid_request"),
    "unknown model": (with_(model="gpt-9"), 404, "model_not_found"),
    "prompt longer than context": (
        with_(messages=[{"role": "user", "content": "word " * 9000}]),
        400,
        "context_length_exceeded",
    ),
}


COMPLETION_CASES = {
    "empty prompt": ({"prompt": ""}, "invalid_request"),
    "token id outside the vocabulary": ({"prompt": [1, 10**6]}, "invalid_request"),
    "suffix": ({"prompt": "x", "suffix": "y"}, "unsupported_parameter"),
    "best_of above n": ({"prompt": "x", "best_of": 2}, "unsupported_parameter"),
    "max_tokens 0 without echo": ({"prompt": "x", "max_tokens": 0}, "invalid_request"),
    "logprobs above 20": ({"prompt": "x", "logprobs": 21}, "invalid_request"),
    "too many prompts": ({"prompt": ["x"] * 33}, "array_above_max_length"),
    "unknown parameter": ({"prompt": "x", "frobnicate": 1}, "unknown_parameter"),
    "chat's messages": ({"prompt": "x", "messages": []}, "unknown_parameter"),
    "unsupported parameter": ({"prompt": "x", "prediction": {}}, "unsupported_parameter"),
    "lone surrogate": (
        b'{"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "prompt": "a\\ud800b"}',
        "invalid_request",
    ),
}

# The field a refusal names (OpenAI's error.param), where the case is about one field.
PARAMS = {
    "unknown parameter": "frobnicate",
    "chat's messages": "messages",
    "unsupported parameter": "prediction",
    "suffix": "suffix",
    "best_of above n": "best_of",
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
async def test_bad_completion_request(stack, case):
    extra, code = COMPLETION_CASES[case]
    kwargs = (
        {"data": extra, "headers": {"Content-Type": "application/json"}}
        if isinstance(extra, bytes)
        else {"json": {"model": MODEL, "max_tokens": 4, **extra}}
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.post(f"{stack.url}/v1/completions", **kwargs) as resp:
            assert resp.status == 400, await resp.text()
            err = (await resp.json())["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error"
    if case in PARAMS:
        assert err["param"] == PARAMS[case] and PARAMS[case] in err["message"]


@pytest.mark.parametrize("case", list(CASES))
async def test_bad_request(stack, case):
    body, status, code = CASES[case]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        kwargs = (
            {"data": body, "headers": {"Content-Type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        async with http.post(f"{stack.url}/v1/chat/completions", **kwargs) as resp:
            assert resp.status == status, await resp.text()
            data = await resp.json()
    err = data["error"]
    assert err["code"] == code
    assert err["type"] == "invalid_request_error"
    assert err["message"] and "Traceback" not in err["message"]
    field = {"unknown parameter": "frobnicate", "unsupported parameter": "audio"}.get(case)
    if field:
        assert err["param"] == field and field in err["message"]


async def test_unknown_route_and_method(stack):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/v1/nope") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "not_found"
        async with http.get(f"{stack.url}/v1/chat/completions") as resp:
            assert resp.status == 405
            assert "error" in await resp.json()


async def test_body_too_large(stack):
    big = b'{"x": "' + b"a" * (5 << 20) + b'"}'
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{stack.url}/v1/chat/completions",
            data=big,
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "payload_too_large"


async def test_health(stack):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/health") as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "ok"
