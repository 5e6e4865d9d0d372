"""The gateway's input limits, with the real tokenizer and chat template."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.gateway.prompt import PromptBuilder
from services.gateway.protocol import parse_request
from shared import errors
from shared.model_context import for_model

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def builder(model_dir: Path) -> PromptBuilder:
    return PromptBuilder(
        model_dir, "m", 8, max_messages=4, max_prompt_tokens=64, max_output_tokens=16
    )


def chat(*contents: str, **extra):
    return parse_request(
        {"model": "m", "messages": [{"role": "user", "content": c} for c in contents], **extra}
    )


def refused(builder: PromptBuilder, request) -> errors.HalfmoonError:
    with pytest.raises(errors.InvalidRequest) as info:
        builder.build(request)
    return info.value


def test_requests_within_the_limits_pass(builder):
    ids, max_tokens = builder.build(chat("a", "b", "c", "hello there", max_tokens=16))
    assert 0 < len(ids) <= 64 and max_tokens == 16
    assert builder.build(chat("hi"))[1] == 8  # the default


def test_each_limit_has_its_code_and_param(builder):
    err = refused(builder, chat("a", "b", "c", "d", "e"))
    assert (err.code, err.param) == ("array_above_max_length", "messages")
    err = refused(builder, chat("hi", max_tokens=17))
    assert (err.code, err.param) == ("integer_above_max_value", "max_tokens")
    err = refused(builder, chat("hi", max_completion_tokens=17))
    assert err.code == "integer_above_max_value"
    err = refused(builder, chat("word " * 80))
    assert (err.code, err.param) == ("context_length_exceeded", "messages")
    assert "64" in err.message


def fastest(fn, rounds: int = 3) -> float:
    """The least time `fn` took in a few rounds (a slow round is the machine, not fn)."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def test_huge_text_is_refused_without_tokenizing_it(builder, monkeypatch):
    # Tokenizing all of it would hold the event loop for seconds; the length check alone
    # must cost less than tokenizing a hundredth of it, timed here on this machine.
    text = "word " * 800_000
    request = chat(text)
    calls: list[int] = []
    tokenize = builder.tokenize

    def counted(messages):
        calls.append(1)
        return tokenize(messages)

    monkeypatch.setattr(builder, "tokenize", counted)
    errs: list[errors.HalfmoonError] = []
    took = fastest(lambda: errs.append(refused(builder, request)))
    assert calls == [] and {e.code for e in errs} == {"context_length_exceeded"}
    hundredth = [{"role": "user", "content": text[: len(text) // 100]}]
    baseline = fastest(lambda: tokenize(hundredth))
    assert took < baseline, (
        f"refusal {took * 1e3:.2f} ms, a hundredth tokenized {baseline * 1e3:.2f} ms"
    )


def test_the_length_check_never_refuses_what_would_fit(builder):
    # The densest text for this tokenizer: its longest token (a newline and 80 spaces),
    # repeated. It fits in 64 tokens; a chars-per-token guess (say 4) would refuse it.
    longest = max(builder.tokenizer.get_vocab(), key=len)
    text = "x" + builder.tokenizer.convert_tokens_to_string([longest]) * 20 + "x"
    ids, _ = builder.build(chat(text))
    assert len(ids) <= 64 and len(text) > 64 * 4


def test_the_context_admitted_is_the_one_the_engines_are_loaded_with(model_dir, builder):
    """--max-model-len caps the context below the model's; --rope-scaling stretches it."""
    long = chat("word " * 10_000)  # about 10k tokens: past the model's 8,192 positions
    err = refused(PromptBuilder(model_dir, "m", 8), long)
    assert err.code == "context_length_exceeded" and "8192" in err.message
    capped = PromptBuilder(model_dir, "m", 8, max_model_len=4096)
    err = refused(capped, chat("word " * 5_000))
    assert err.code == "context_length_exceeded" and "4096" in err.message
    stretched = for_model(model_dir, rope_scaling="yarn:4").max_model_len
    assert stretched == 32768
    ids, _ = PromptBuilder(model_dir, "m", 8, max_model_len=stretched).build(long)
    assert 8192 < len(ids) < 32768
