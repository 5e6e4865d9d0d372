"""Structured output: which constraint a request asks for, as the bus's Constraint.

OpenAI's `response_format` (json_object, json_schema), vLLM's `guided_*` fields and its
`structured_outputs` object, and `tool_choice` required or named (a Lark grammar around
the tool-call format, with each function's arguments schema inside). At most one per
request. The grammar is compiled here, before placement, so a bad one is a 400 and not a
failed stream; the engine compiles it again for the request it runs.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.protocol import (
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    SamplingFields,
    StructuredOutputs,
)
from shared import errors
from shared.messages import Constraint


def _json_spec(value: dict[str, Any] | str, param: str) -> str:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            raise errors.InvalidRequest(
                f"{param}: not a JSON schema (invalid JSON)", param=param
            ) from None
        if not isinstance(parsed, (dict, bool)):
            raise errors.InvalidRequest(f"{param}: a JSON schema is an object", param=param)
        return value
    return json.dumps(value)


def requested(req: SamplingFields) -> list[tuple[str, Constraint]]:
    """Every constraint the request names, with the parameter that named it."""
    out: list[tuple[str, Constraint]] = []
    rf = req.response_format
    if isinstance(rf, JsonObjectFormat):
        out.append(("response_format", Constraint(kind="json_object")))
    elif isinstance(rf, JsonSchemaResponseFormat):
        out.append(
            (
                "response_format",
                Constraint(kind="json_schema", spec=json.dumps(rf.json_schema.schema_)),
            )
        )
    if req.guided_json is not None:
        out.append(
            (
                "guided_json",
                Constraint(kind="json_schema", spec=_json_spec(req.guided_json, "guided_json")),
            )
        )
    if req.guided_regex is not None:
        out.append(("guided_regex", Constraint(kind="regex", spec=req.guided_regex)))
    if req.guided_choice is not None:
        out.append(("guided_choice", Constraint(kind="choice", spec=json.dumps(req.guided_choice))))
    if req.guided_grammar is not None:
        out.append(("guided_grammar", Constraint(kind="lark", spec=req.guided_grammar)))
    if req.structured_outputs is not None:
        out.append(_structured_outputs(req.structured_outputs))
    return out


def _structured_outputs(so: StructuredOutputs) -> tuple[str, Constraint]:
    """vLLM's `structured_outputs`: exactly one of its fields, named as its parameter."""
    given = [
        key
        for key, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise errors.InvalidRequest(
            "structured_outputs takes exactly one of json, regex, choice, grammar",
            param="structured_outputs",
        )
    param = f"structured_outputs.{given[0]}"
    if so.json_ is not None:
        return param, Constraint(kind="json_schema", spec=_json_spec(so.json_, param))
    if so.choice is not None:
        return param, Constraint(kind="choice", spec=json.dumps(so.choice))
    if so.regex is not None:
        return param, Constraint(kind="regex", spec=so.regex)
    assert so.grammar is not None  # the one given
    return param, Constraint(kind="lark", spec=so.grammar)


def one_constraint(found: list[tuple[str, Constraint]]) -> tuple[str, Constraint] | None:
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise errors.InvalidRequest(
            f"one structured-output constraint per request; this one has {names}", param=found[1][0]
        )
    return found[0] if found else None


class ConstraintChecker:
    """Compiles constraints against the served tokenizer (llguidance, as the engine does)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def warm(self) -> None:
        """Build the tokenizer's tables once (about a second), before the first request."""
        self.check("response_format", Constraint(kind="json_object"))

    def check(self, param: str, constraint: Constraint) -> None:
        from shared.engine import constraints
        from shared.engine.params import Constraint as EngineConstraint

        try:
            constraints.validate(
                self.tokenizer, self.vocab_size, EngineConstraint(constraint.kind, constraint.spec)
            )
        except ValueError as exc:
            raise errors.InvalidRequest(
                f"{param}: {exc}", param=param, code="invalid_grammar"
            ) from None
