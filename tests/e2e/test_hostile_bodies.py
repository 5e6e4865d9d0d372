"""Bodies no schema names, generated as a hostile client would send them: deep nesting,
duplicate keys, numbers past any range, odd Unicode and broken UTF-8, wrong content types
and truncated bodies. Against a real stack, none gets a 5xx: each is served or refused
with an OpenAI-style 4xx error, and no traceback reaches the client.

(schemathesis, in test_fuzz.py, generates from /openapi.json, so it never sends these.)
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
# Bounded so the run takes a minute or two on two cores; HALFMOON_FUZZ_SEED explores more.
MAX_EXAMPLES = 60
SEED = int(os.environ.get("HALFMOON_FUZZ_SEED", "20261203"))
ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize")


def base(route: str) -> dict:
    """A valid body for `route`, one token long: what the hostile shapes are grafted onto."""
    if route == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    if route == "/v1/completions":
        return {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    return {"model": MODEL, "prompt": "Hi"}


NUMBERS = st.sampled_from(
    [
        "1e400",
        "-1e400",
        "NaN",
        "Infinity",
        "-Infinity",
        "-0",
        "1" * 5000,  # past Python's int-from-text digit limit
        "18446744073709551616",
        "-9223372036854775809",
        "0.0000000000000000000000000001",
        "1E+2",
        "3.0",
    ]
)
FIELDS = st.sampled_from(
    ["max_tokens", "temperature", "top_p", "n", "seed", "logprobs", "top_logprobs", "stop"]
    + ["presence_penalty", "frequency_penalty", "logit_bias", "model", "messages", "prompt"]
)
TEXTS = st.sampled_from(
    [
        '"\\ud800"',  # a lone surrogate, escaped
        '"\\udfff\\ud800"',
        '"\\u0000"',
        '"\u202e\u2066reversed"',
        '"\ufeffbom"',
        '"' + "\U0001f600" * 100 + '"',
        '"' + "a" * 70_000 + '"',
    ]
)


def nested(depth: int, opener: str) -> str:
    """`depth` arrays or objects, one inside the other."""
    if opener == "[":
        return "[" * depth + "1" + "]" * depth
    return '{"k": ' * depth + "1" + "}" * depth


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(route, body bytes, content type)."""
    route = draw(st.sampled_from(ROUTES))
    good = json.dumps(base(route))
    kind = draw(
        st.sampled_from(["nesting", "duplicate", "number", "unicode", "bytes", "truncated"])
    )
    field = draw(FIELDS)
    if kind == "nesting":
        depth = draw(st.sampled_from([64, 1000, 20_000, 200_000]))
        value = nested(depth, draw(st.sampled_from(["[", "{"])))
        raw = good[:-1] + f', "{field}": {value}}}'
        if draw(st.booleans()):  # or the whole body is the nest
            raw = value
    elif kind == "duplicate":
        raw = good[:-1] + f', "{field}": 1, "{field}": {draw(NUMBERS)}}}'
    elif kind == "number":
        raw = good[:-1] + f', "{field}": {draw(NUMBERS)}}}'
    elif kind == "unicode":
        raw = good[:-1] + f', "{field}": {draw(TEXTS)}}}'
    else:
        raw = good
    data = raw.encode("utf-8", "surrogatepass")
    if kind == "bytes":  # not UTF-8 at all, at a random place
        at = draw(st.integers(0, len(data)))
        data = (
            data[:at] + draw(st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80"])) + data[at:]
        )
    elif kind == "truncated":
        data = data[: draw(st.integers(0, len(data) - 1))]
    content_type = draw(
        st.sampled_from(
            [
                "application/json",
                "application/json",
                "text/plain",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x",
                "application/json; charset=latin-1",
            ]
        )
    )
    return route, data, content_type


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@seed(SEED)
@given(case=hostile())
def test_no_hostile_body_gets_a_5xx(stack, case):
    route, data, content_type = case
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        resp = http.post(route, content=data, headers={"Content-Type": content_type})
    assert resp.status_code < 500, (route, data[:300], resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"] and error["type"], resp.text
        assert "Traceback" not in resp.text
    assert resp.headers.get("X-Request-Id")
