"""Request validation for chat and text completions: what is refused, by name, and what
null and the vLLM-style extensions mean. No model, no stack."""

from __future__ import annotations

import json

import pytest

from services.gateway.completion_protocol import parse_completion
from services.gateway.httputil import check_unicode
from services.gateway.protocol import parse_request
from services.gateway.structured import one_constraint, requested
from shared import errors

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(body: dict, parse=parse_request) -> errors.HalfmoonError:
    with pytest.raises(errors.InvalidRequest) as info:
        parse(body)
    return info.value


def test_null_means_the_default_and_top_k_minus_one_is_off():
    req = parse_request(
        {
            **CHAT,
            "temperature": None,
            "top_p": None,
            "n": None,
            "stream": None,
            "stop": None,
            "seed": None,
            "top_k": -1,
            "stream_options": None,
            "max_tokens": None,
        }
    )
    assert (req.temperature, req.top_p, req.n, req.stream) == (1.0, 1.0, 1, False)
    assert req.sampling(8).top_k == 0


def test_unknown_and_unsupported_parameters_are_named():
    err = refused({**CHAT, "frobnicate": 1})
    assert (err.param, err.code) == ("frobnicate", "unknown_parameter")
    assert "Unrecognized request argument supplied: frobnicate" in err.message
    for name, value in (
        ("audio", {"voice": "x"}),
        ("modalities", ["text", "audio"]),
        ("functions", []),
        ("store", True),
        ("suffix", "x"),
    ):
        err = refused({**CHAT, name: value})
        assert (err.param, err.code) == (name, "unsupported_parameter"), name
    # OpenAI's defaults for them change nothing, and pass.
    parse_request({**CHAT, "modalities": ["text"], "store": False, "service_tier": "auto"})


def test_sampling_fields_reach_the_bus():
    req = parse_request(
        {
            **CHAT,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "min_p": 0.1,
            "logit_bias": {"42": 5},
            "min_tokens": 3,
            "stop_token_ids": [7],
            "seed": 9,
            "logprobs": True,
            "top_logprobs": 4,
        }
    )
    s = req.sampling(16, req.engine_logprobs())
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (
        0.5,
        -0.5,
        1.2,
        0.1,
    )
    assert (s.logit_bias, s.min_tokens, s.stop_token_ids, s.seed, s.logprobs) == (
        {42: 5.0},
        3,
        [7],
        9,
        4,
    )
    assert parse_request({**CHAT, "logprobs": True}).engine_logprobs() == 0
    assert parse_request(CHAT).engine_logprobs() is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages.0.tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
        ),
    ],
)
def test_refusals_name_the_parameter(extra, param):
    assert refused({**CHAT, **extra}).param == param


def test_tool_choice_auto_without_tools_is_plain_text():
    # As the schema says: only "required" (or a named tool) needs tools (found by fuzzing).
    assert parse_request({**CHAT, "tool_choice": "auto"}).effective_tool_choice() == "none"
    assert parse_request({**CHAT, "tool_choice": "auto", "tools": []}).tools == []


def test_a_named_tool_must_be_one_of_the_tools():
    tools = [{"type": "function", "function": {"name": "f"}}]
    parse_request(
        {**CHAT, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    )
    err = refused(
        {**CHAT, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}
    )
    assert err.param == "tool_choice"


def test_a_tool_call_round_trip_validates():
    req = parse_request(
        {
            **CHAT,
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        }
    )
    assert req.messages[1].tool_calls[0].function.name == "get_weather"
    assert req.messages[2].tool_call_id == "call_1"


def test_lone_surrogates_are_a_400_that_says_where():
    body = json.loads('{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    with pytest.raises(errors.InvalidRequest) as info:
        check_unicode(body)
    assert info.value.param == "messages.0.content"
    check_unicode({"messages": [{"content": "fine \u00e9\U0001f600"}]})


def test_completion_prompts_in_every_form():
    def prompts(p):
        return parse_completion({"model": "m", "prompt": p}).prompts()

    assert prompts("x") == ["x"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ("", [], [[]], [""], [True], [[1], "a"]):
        refused({"model": "m", "prompt": bad}, parse_completion)


def test_completion_echo_logprobs_and_best_of():
    req = parse_completion(
        {"model": "m", "prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0}
    )
    assert (req.echo, req.engine_logprobs(), req.max_tokens) == (True, 1, 0)
    assert (
        refused({"model": "m", "prompt": "x", "max_tokens": 0}, parse_completion).param
        == "max_tokens"
    )
    assert (
        refused({"model": "m", "prompt": "x", "logprobs": 21}, parse_completion).param == "logprobs"
    )
    parse_completion({"model": "m", "prompt": "x", "n": 2, "best_of": 2})
    assert (
        refused({"model": "m", "prompt": "x", "best_of": 3}, parse_completion).code
        == "unsupported_parameter"
    )


def test_structured_output_requests_map_to_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = {
        "response_format": (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                }
            },
            "json_schema",
        ),
        "response_format ": ({"response_format": {"type": "json_object"}}, "json_object"),
        "guided_json": ({"guided_json": schema}, "json_schema"),
        "guided_regex": ({"guided_regex": "[0-9]+"}, "regex"),
        "guided_choice": ({"guided_choice": ["yes", "no"]}, "choice"),
        "guided_grammar": ({"guided_grammar": 'start: "a"'}, "lark"),
        "structured_outputs.regex": ({"structured_outputs": {"regex": "a+"}}, "regex"),
    }
    for param, (extra, kind) in cases.items():
        found = one_constraint(requested(parse_request({**CHAT, **extra})))
        assert found is not None and (found[0], found[1].kind) == (param.strip(), kind)
    assert (
        one_constraint(requested(parse_request({**CHAT, "response_format": {"type": "text"}})))
        is None
    )
    with pytest.raises(errors.InvalidRequest):
        one_constraint(
            requested(parse_request({**CHAT, "guided_regex": "a", "guided_choice": ["a"]}))
        )
    with pytest.raises(errors.InvalidRequest):
        requested(parse_request({**CHAT, "structured_outputs": {"regex": "a", "choice": ["a"]}}))
    with pytest.raises(errors.InvalidRequest):
        requested(parse_request({**CHAT, "guided_json": "{not json"}))


@pytest.mark.parametrize("name", ["top_k", "min_tokens"])
def test_a_count_past_what_json_holds_exactly_is_refused_by_name(name):
    # The bus carries counts below 2**53; a larger one was once a 500 (found by fuzzing).
    assert refused({**CHAT, name: 2**82}).param == name
    assert refused({"model": "m", "prompt": "x", name: 2**53}, parse_completion).param == name
    assert parse_request({**CHAT, name: 2**53 - 1}).sampling(8).model_dump()[name] == 2**53 - 1
