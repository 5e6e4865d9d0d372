"""Tool calls (rendering, streaming parse, forcing grammar) and logprob token strings, with
the real tokenizer and llguidance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gateway.logprobs import CompletionLogprobs, TokenTexts, chat_entries
from services.gateway.prompt import PromptBuilder
from services.gateway.protocol import NamedToolChoice, Tool, parse_request
from services.gateway.structured import ConstraintChecker
from services.gateway.tools import HermesFormat, StreamingCalls, format_for
from shared import errors
from shared.messages import Constraint, TokenLogprob

pytestmark = pytest.mark.model
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def builder(model_dir: Path) -> PromptBuilder:
    return PromptBuilder(model_dir, "m", 8)


def test_the_default_models_template_gets_the_fallback_and_renders_a_round_trip(builder):
    assert not builder.template_renders_tools
    assert isinstance(builder.tool_format, HermesFormat)
    chat = parse_request(
        {
            "model": "m",
            "tools": [WEATHER],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
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
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
            ],
        }
    )
    messages, tools = builder.render_messages(chat)
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in system
    assert "<tool_call></tool_call>" in system
    assert json.loads(messages[2]["content"].split("\n")[1]) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert messages[3] == {
        "role": "user",
        "content": '<tool_response>\n{"name": '
        '"get_weather", "content": "sunny, 21 C"}\n</tool_response>',
    }
    text = builder.tokenizer.decode(builder.tokenize(messages, tools))
    assert "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    none = parse_request(
        {
            "model": "m",
            "tools": [WEATHER],
            "tool_choice": "none",
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    assert "# Tools" not in str(builder.render_messages(none)[0])


def test_calls_are_parsed_from_a_stream_in_any_pieces():
    fmt = format_for("llama")
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome")
    for size in (1, 3, 7, len(text)):
        calls = StreamingCalls(fmt)
        content, found = [], []
        for i in range(0, len(text), size):
            c, new = calls.feed(text[i : i + size])
            content.append(c)
            found += new
        c, new = calls.finish()
        content.append(c)
        found += new
        assert "".join(content).strip() == "Let me check."
        assert [json.loads(f.arguments)["city"] for f in found] == ["Paris", "Rome"]
        assert all(f.name == "get_weather" and f.id.startswith("call_") for f in found)


def test_what_is_not_a_call_stays_text():
    calls = StreamingCalls(format_for("llama"))
    text = "a < b, and <tool_call>not json</tool_call> <tool_c"
    out, found = calls.feed(text)
    more, last = calls.finish()
    assert out + more == text and found == last == []
    single = StreamingCalls(format_for("llama"), parallel=False)
    _, found = single.feed(CALL + CALL)
    assert len(found) == 1


def test_the_forcing_grammar_compiles_and_accepts_only_calls(builder):
    fmt = format_for("llama")
    checker = ConstraintChecker(builder.tokenizer, builder.vocab_size)
    tools = [
        Tool.model_validate(WEATHER),
        Tool.model_validate({"type": "function", "function": {"name": "noop"}}),
    ]
    for choice, parallel in (
        ("required", True),
        ("required", False),
        (NamedToolChoice.model_validate({"type": "function", "function": {"name": "noop"}}), False),
    ):
        grammar = fmt.grammar(tools, choice, parallel)
        checker.check("tool_choice", Constraint(kind="lark", spec=grammar))
    from shared.engine.constraints import matcher
    from shared.engine.params import Constraint as EngineConstraint

    m = matcher(
        builder.tokenizer,
        builder.vocab_size,
        EngineConstraint("lark", fmt.grammar(tools, "required", False)),
    )
    assert m.consume_tokens(builder.tokenizer(CALL)["input_ids"]) and m.is_accepting()
    with pytest.raises(errors.InvalidRequest) as info:
        checker.check("guided_regex", Constraint(kind="regex", spec="(?=a)b"))
    assert info.value.code == "invalid_grammar" and "look-around" in info.value.message


def test_token_strings_and_bytes_are_exact_for_byte_level_tokens(builder):
    texts = TokenTexts(builder.tokenizer)
    ids = builder.tokenizer("Paris é 😀")["input_ids"]
    raw = b"".join(bytes(texts.of(t)[1]) for t in ids)
    assert raw.decode() == "Paris é 😀"
    partial = [t for t in ids if texts.of(t)[0].startswith("bytes:")]
    assert partial, "the emoji's bytes span tokens that are not whole characters"
    eos = builder.tokenizer.eos_token_id
    assert texts.of(eos) == ("<|im_end|>", list(b"<|im_end|>"))
    lp = TokenLogprob(token_id=ids[0], logprob=-0.5, top=[(ids[0], -0.5), (ids[1], -2.0)])
    entry = chat_entries(texts, [lp], 1)[0]
    assert entry["token"] == "Paris" and entry["bytes"] == list(b"Paris")
    assert [t["token"] for t in entry["top_logprobs"]] == ["Paris"]
    legacy = CompletionLogprobs(texts, 0)
    legacy.add_unscored(ids[0])
    legacy.add([lp])
    body = legacy.take()
    assert body["token_logprobs"] == [None, -0.5]
    assert body["top_logprobs"] == [None, {"Paris": -0.5}]  # the chosen token, always
    assert body["text_offset"] == [0, 5]


def test_a_template_that_refuses_the_messages_is_a_400(model_dir):
    b = PromptBuilder(model_dir, "m", 8)
    b.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(errors.InvalidRequest) as info:
        b.build(parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert info.value.code == "invalid_messages" and "roles must alternate" in info.value.message
