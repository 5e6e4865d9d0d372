"""The gateway's JSON decoding (httputil.decode_json): every failure is the client's 400,
saying what was wrong, never an exception that would be a 500."""

from __future__ import annotations

import pytest

from services.gateway.httputil import MAX_JSON_DEPTH, decode_json, json_depth
from shared import errors


def nest(depth: int) -> bytes:
    return (b'{"k": ' * depth) + b"1" + (b"}" * depth)


def refused(raw: bytes) -> str:
    with pytest.raises(errors.InvalidRequest) as caught:
        decode_json(raw)
    assert caught.value.status == 400
    return caught.value.message


def test_nesting_up_to_the_limit_is_read_and_past_it_refused():
    assert json_depth(decode_json(nest(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    assert "more than 64 levels deep" in refused(nest(MAX_JSON_DEPTH + 1))
    # Past what the parser itself can take: the same 400, not a RecursionError.
    assert "more than 64 levels deep" in refused(b"[" * 200_000 + b"]" * 200_000)


def test_json_depth_counts_arrays_and_objects():
    assert json_depth(1) == 0
    assert json_depth({"a": [1, {"b": []}]}) == 4  # an empty array is a level too


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"model": "m", "max_tokens": ' + b"1" * 5000 + b"}", "a number has too many digits"),
        (b'{"model": "\xff"}', "not UTF-8 text"),
        (b'{"model": "m", "max_tok', "line 1 column"),
        (b"", "Expecting value"),
    ],
)
def test_malformed_bodies_say_what_is_wrong(raw, says):
    message = refused(raw)
    assert message.startswith("request body is not valid JSON") and says in message
