"""Mistral's [TOOL_CALLS] format beside Hermes': parsing whole and streamed replies, call
ids, the forcing grammar against the real tokenizer and llguidance, the choice of format,
and the engine keeping a special token in the text when a request asks it to."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from services.gateway.args import parse_args
from services.gateway.mistral_tools import MistralFormat
from services.gateway.prompt import PromptBuilder, special_tokens
from services.gateway.protocol import NamedToolChoice, Tool, parse_request
from services.gateway.structured import ConstraintChecker
from services.gateway.tools import (
    FORMATS,
    HermesFormat,
    StreamingCalls,
    format_for,
    skip_special_tokens,
)
from shared.engine.constraints import matcher
from shared.engine.engine_core import EngineCore
from shared.engine.output import decode_all, make_detokenizer
from shared.engine.params import Constraint as EngineConstraint
from shared.engine.params import SamplingParams as EngineParams
from shared.engine.sequence import Sequence
from shared.messages import Constraint, SamplingParams

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
NOOP = {"type": "function", "function": {"name": "noop"}}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'


def run(calls: StreamingCalls, text: str, size: int) -> tuple[list[str], list, list]:
    """Feed `text` in pieces of `size`: the content of each delta (finish()'s last), the
    calls found before finish(), and all of them."""
    content, early = [], []
    for i in range(0, len(text), size):
        c, new = calls.feed(text[i : i + size])
        content.append(c)
        early += new
    c, last = calls.finish()
    return [*content, c], early, early + last


def cities(found) -> list[str]:
    return [json.loads(f.arguments)["city"] for f in found]


# -- parsing ------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_mistral_calls_are_held_to_the_end_and_text_before_them_streams(size):
    text = f"Let me check.[TOOL_CALLS] [{PARIS}, {ROME}]"
    content, early, found = run(StreamingCalls(format_for("mistral")), text, size)
    assert early == []  # no close marker: parsed only at finish()
    assert cities(found) == ["Paris", "Rome"]
    assert all(f.name == "get_weather" for f in found)
    assert "".join(content) == "Let me check."
    # The text before the marker went out before the reply ended, the marker never did.
    assert "".join(content[:-1]) == "Let me check."
    assert not any("[" in c for c in content)


def test_the_marker_split_across_deltas_is_held_not_streamed():
    calls = StreamingCalls(format_for("mistral"))
    assert calls.feed("ok [TOOL") == ("ok ", [])
    assert calls.feed("_CALLS] [") == ("", [])
    assert calls.feed(PARIS) == ("", [])
    text, found = calls.finish()
    assert (text, found) == ("[TOOL_CALLS] [" + PARIS, [])  # never closed: text, not lost
    calls = StreamingCalls(format_for("mistral"))
    deltas = [calls.feed(p)[0] for p in ("[", "TOOL_CA", "LLS]", f" [{PARIS}", "]")]
    text, found = calls.finish()
    assert deltas == [""] * 5 and text == "" and cities(found) == ["Paris"]


def test_a_held_bracket_that_is_not_the_marker_comes_back_as_text():
    calls = StreamingCalls(format_for("mistral"))
    assert calls.feed("a list [") == ("a list ", [])
    assert calls.feed("1, 2]") == ("[1, 2]", [])
    assert calls.finish() == ("", [])


def test_one_object_and_parameters_are_taken_too():
    fmt = format_for("mistral")
    one = fmt.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert one is not None and cities(one) == ["Oslo"]
    as_text = fmt.parse('[{"name": "noop", "arguments": "{}"}]')
    assert as_text is not None and as_text[0].arguments == "{}"
    again = fmt.parse(f"[{PARIS}] [TOOL_CALLS] [{ROME}]")
    assert again is not None and cities(again) == ["Paris", "Rome"]


@pytest.mark.parametrize(
    "block",
    [
        '[{"name": "get_weather", "arguments": {"city": }]',  # bad JSON
        f"[{PARIS}] and some words",  # trailing text
        "[]",  # no calls
        '[{"arguments": {}}]',  # no name
        '[{"name": "noop", "arguments": [1]}]',  # arguments not an object
        f'[{PARIS}, "noop"]',  # one item not a call: none of it is taken
    ],
)
def test_what_does_not_parse_stays_content_whole(block):
    text = "Sure. [TOOL_CALLS] " + block
    content, _, found = run(StreamingCalls(format_for("mistral")), text, 3)
    assert found == [] and "".join(content) == text


def test_only_the_first_call_when_parallel_calls_are_off():
    calls = StreamingCalls(format_for("mistral"), parallel=False)
    calls.feed(f"[TOOL_CALLS] [{PARIS}, {ROME}]")
    text, found = calls.finish()
    assert text == "" and cities(found) == ["Paris"]


def test_mistral_ids_are_nine_letters_or_digits_and_hermes_keeps_its_own():
    fmt = format_for("mistral")
    found = fmt.parse(", ".join([PARIS] * 50).join("[]"))
    assert found is not None and len(found) == 50
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", f.id) for f in found)
    assert len({f.id for f in found}) == 50
    hermes = format_for("llama").parse(PARIS)
    assert hermes is not None and re.fullmatch(r"call_[A-Za-z0-9]{24}", hermes[0].id)


def test_hermes_parse_is_one_call_or_none():
    fmt = HermesFormat()
    assert fmt.parse("not json") is None and fmt.parse('{"name": 1}') is None
    assert cities(fmt.parse(PARIS) or []) == ["Paris"]


# -- choosing a format ----------------------------------------------------------------------
def test_each_family_gets_its_format_and_an_override_wins():
    assert type(format_for("mistral")) is MistralFormat
    for family in ("llama", "qwen2", "qwen3", "phi3", "something-new"):
        assert type(format_for(family)) is HermesFormat
    assert type(format_for("llama", "mistral")) is MistralFormat
    assert type(format_for("mistral", "hermes")) is HermesFormat
    with pytest.raises(ValueError, match="unknown tool format 'xml'"):
        format_for("llama", "xml")
    assert set(FORMATS) == {"hermes", "mistral"}
    assert MistralFormat.needs_special_tokens and not HermesFormat.needs_special_tokens


def test_the_gateway_flag_takes_known_formats_only(capsys):
    assert parse_args(["--tool-format", "mistral"]).tool_format == "mistral"
    with pytest.raises(SystemExit):
        parse_args(["--tool-format", "xml"])
    assert "unknown tool format 'xml'" in capsys.readouterr().err


# -- with the real tokenizer -------------------------------------------------------------
@pytest.fixture(scope="module")
def mistral_builder(model_dir: Path) -> PromptBuilder:
    """The default model, told to use Mistral's format (its template has no tool section)."""
    return PromptBuilder(model_dir, "m", 8, tool_format="mistral")


@pytest.mark.model
def test_the_fallback_renders_a_mistral_round_trip(mistral_builder):
    b = mistral_builder
    assert type(b.tool_format) is MistralFormat and not b.template_renders_tools
    call = {"id": "abcDEF123", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    chat = parse_request(
        {
            "model": "m",
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
            ],
        }
    )
    messages, tools = b.render_messages(chat)
    assert tools is None and messages[0]["role"] == "system"
    listed = re.search(r"\[AVAILABLE_TOOLS\] (.*)\[/AVAILABLE_TOOLS\]", messages[0]["content"])
    assert listed and json.loads(listed.group(1))[0]["function"]["name"] == "get_weather"
    assert "[TOOL_CALLS] [{" in messages[0]["content"]
    assert messages[2]["content"].startswith("[TOOL_CALLS] ")
    assert json.loads(messages[2]["content"].removeprefix("[TOOL_CALLS] ")) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}
    ]
    assert messages[3] == {
        "role": "user",
        "content": '[TOOL_RESULTS] {"content": "sunny", "call_id": "abcDEF123"}[/TOOL_RESULTS]',
    }
    # Tools in effect with a special marker: the engine is told to keep special tokens.
    assert b.reply_format(chat) is b.tool_format
    assert skip_special_tokens(b.reply_format(chat)) is False
    off = parse_request({**chat.model_dump(exclude_none=True), "tool_choice": "none"})
    assert b.reply_format(off) is None and skip_special_tokens(None) is True
    assert skip_special_tokens(HermesFormat()) is True


def accepts(tokenizer, grammar: str, ids: list[int]) -> bool:
    m = matcher(tokenizer, len(tokenizer), EngineConstraint("lark", grammar))
    return bool(m.consume_tokens(ids) and m.is_accepting())


@pytest.mark.model
def test_the_mistral_grammar_compiles_and_accepts_only_calls(mistral_builder):
    b, fmt = mistral_builder, mistral_builder.tool_format
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(NOOP)]
    checker = ConstraintChecker(b.tokenizer, b.vocab_size)
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "noop"}})
    for choice, parallel in (("required", True), ("required", False), (named, False)):
        checker.check(
            "tool_choice", Constraint(kind="lark", spec=fmt.grammar(tools, choice, parallel))
        )
    one, many = fmt.grammar(tools, "required", False), fmt.grammar(tools, "required", True)

    def ids(text: str) -> list[int]:
        return b.tokenizer(text, add_special_tokens=False)["input_ids"]

    assert accepts(b.tokenizer, one, ids(f"[TOOL_CALLS] [{PARIS}]"))
    assert accepts(b.tokenizer, many, ids(f"[TOOL_CALLS] [{PARIS}, {ROME}]"))
    assert not accepts(b.tokenizer, one, ids(f"[TOOL_CALLS] [{PARIS}, {ROME}]"))
    assert not accepts(
        b.tokenizer, one, ids('[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}]')
    )
    assert not accepts(b.tokenizer, one, ids(f"[{PARIS}]"))  # no marker
    assert not accepts(
        b.tokenizer, fmt.grammar(tools, named, False), ids(f"[TOOL_CALLS] [{PARIS}]")
    )


@pytest.mark.model
def test_a_special_marker_is_forced_as_its_token(model_dir):
    """Where [TOOL_CALLS] is a special token (as in Mistral's tokenizer), the grammar names
    it by id: llguidance never matches a special token with literal text."""
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    fmt = format_for("mistral", special_tokens=special_tokens(tok))
    grammar = fmt.grammar([Tool.model_validate(WEATHER)], "required", False)
    assert grammar.startswith(f'start: <[{marker}]> " ["')
    rest = tok(f" [{PARIS}]", add_special_tokens=False)["input_ids"]
    spelled = tok("[TOOL_CALLS]", add_special_tokens=False, split_special_tokens=True)
    assert accepts(tok, grammar, [marker, *rest])
    assert not accepts(tok, grammar, [*spelled["input_ids"], *rest])
    # Hermes never names a marker by id: its markers must reach the parser as text.
    assert '"<tool_call>' in HermesFormat({"<tool_call>": 7}).grammar(
        [Tool.model_validate(WEATHER)], "required", False
    )


# -- the engine keeps special tokens when asked ---------------------------------------------
def test_the_flag_crosses_from_the_bus_to_the_engine():
    assert SamplingParams().skip_special_tokens is True
    assert EngineParams.of(SamplingParams(skip_special_tokens=False)).skip_special_tokens is False
    assert EngineParams.of(SamplingParams()).skip_special_tokens is True


@pytest.mark.model
def test_the_detokenizer_keeps_a_special_token_when_told(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = "Hi<|im_start|> there"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    kept = make_detokenizer(tok, [], skip_special_tokens=False)
    assert "".join(kept.step(t) for t in ids) == text
    dropped = make_detokenizer(tok, [])
    assert "".join(dropped.step(t) for t in ids) == "Hi there"
    assert decode_all(tok, ids, skip_special_tokens=False) == text
    assert decode_all(tok, ids) == "Hi there"
    # A tokenizer without a fast backend decodes whole, with the same flag.
    slow = SimpleNamespace(decode=tok.decode)
    assert "".join(make_detokenizer(slow, [], False).step(t) for t in ids) == text
    assert "".join(make_detokenizer(slow, []).step(t) for t in ids) == "Hi there"


@pytest.mark.model
def test_a_request_continued_on_the_engine_keeps_its_special_tokens(model_dir):
    """register() (a request that continues here after tokens made elsewhere) decodes
    what came before, and what comes next, with the request's own setting."""
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok("[x]<|im_start|> done", add_special_tokens=False)["input_ids"]
    lm = SimpleNamespace(tokenizer=tok, eos_token_ids=frozenset(), max_model_len=1000)
    core = SimpleNamespace(requests={}, lm=lm)
    for skip, text in ((False, "[x]<|im_start|> done"), (True, "[x] done")):
        params = EngineParams(skip_special_tokens=skip)
        seq = Sequence(f"r{skip}", [1, 2, *ids], 2, params)
        req = EngineCore.register(core, seq, output_token_ids=ids[:2])
        for t in ids[2:]:
            req.tracker.append(t)
        assert req.tracker.text == text
