"""Structured output in the engine, on the real model: every sample of a constrained
request matches its JSON schema, regex or choice; unconstrained requests in the same batch
are untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.tools.bench.schemas import SCHEMAS
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import Constraint, SamplingParams
from shared.engine.runner import load_model

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def lm(model_dir):
    return load_model(model_dir, "float32", threads=2)


def chat(lm, text: str) -> list[int]:
    return lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )["input_ids"]


def run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    text: dict[str, str] = {}
    reasons = {}
    while engine.has_work():
        for out in engine.step():
            text[out.request_id] = text.get(out.request_id, "") + out.text
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    return text, reasons


def test_json_schema_samples_always_validate(lm):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=256 << 20))
    reqs = []
    for i in range(12):
        schema = SCHEMAS[i % len(SCHEMAS)]
        params = SamplingParams(
            temperature=0.9,
            seed=i,
            max_tokens=96,
            constraint=Constraint("json_schema", json.dumps(schema)),
        )
        reqs.append((f"s{i}", chat(lm, "Describe something as JSON."), params))
    text, reasons = run(engine, reqs)
    for i in range(12):
        value = json.loads(text[f"s{i}"])
        jsonschema.validate(value, SCHEMAS[i % len(SCHEMAS)])
        assert reasons[f"s{i}"].value == "stop"


def test_regex_choice_and_json_object(lm):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=256 << 20))
    reqs = [
        (
            "re",
            chat(lm, "A date?"),
            SamplingParams(
                temperature=0.8,
                seed=1,
                max_tokens=32,
                constraint=Constraint("regex", r"\d{4}-\d{2}-\d{2}"),
            ),
        ),
        (
            "ch",
            chat(lm, "Pick a color."),
            SamplingParams(
                temperature=0.8,
                seed=2,
                max_tokens=16,
                constraint=Constraint("choice", json.dumps(["red", "green", "blue"])),
            ),
        ),
        (
            "js",
            chat(lm, "Any JSON object."),
            SamplingParams(
                temperature=0.8, seed=3, max_tokens=64, constraint=Constraint("json_object")
            ),
        ),
    ]
    text, _ = run(engine, reqs)
    import re

    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", text["re"])
    assert text["ch"] in ("red", "green", "blue")
    assert isinstance(json.loads(text["js"]), dict)


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(lm):
    prompts = [chat(lm, q) for q in ("What is the capital of France?", "Name three colors.")]
    alone = LLMEngine(lm, EngineConfig(kv_cache_bytes=256 << 20))
    ref, _ = run(
        alone,
        [(f"u{i}", p, SamplingParams(temperature=0, max_tokens=24)) for i, p in enumerate(prompts)],
    )
    mixed = LLMEngine(lm, EngineConfig(kv_cache_bytes=256 << 20))
    got, _ = run(
        mixed,
        [(f"u{i}", p, SamplingParams(temperature=0, max_tokens=24)) for i, p in enumerate(prompts)]
        + [
            (
                "c",
                prompts[0],
                SamplingParams(
                    temperature=0,
                    max_tokens=48,
                    constraint=Constraint("json_schema", json.dumps(SCHEMAS[0])),
                ),
            )
        ],
    )
    assert {k: got[k] for k in ref} == ref


def test_an_invalid_grammar_is_refused_with_why(lm):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    with pytest.raises(ValueError, match="regex"):
        engine.add_request(
            "bad", chat(lm, "x"), SamplingParams(constraint=Constraint("regex", "(unclosed"))
        )
    assert "bad" not in engine.requests
