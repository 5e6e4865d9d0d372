"""The JSON schemas for structured output: the one set `bench structured` and the tests
constrain requests with (flat and nested objects, strings, bounded numbers, enums, arrays).

Every string, array and number is bounded, so a constrained sample always closes its object
well within a test's max_tokens and ends with "stop" (an unbounded number or string could
run to the token limit and leave the JSON unfinished).
"""

from __future__ import annotations

from typing import Any

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
        "required": ["ok", "level"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 30}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
]
