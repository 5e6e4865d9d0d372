"""What every request body's model shares: strict types ("5" is not a number), unknown
fields refused, `null` as "not given", and integral floats as integers (JSON has one number
type). The fields themselves are in protocol.py and completion_protocol.py."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator


def drop_nulls(data: Any) -> Any:
    """`null` means "not given": the field's default applies."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None}
    return data


def integral_fields(data: Any, names: tuple[str, ...]) -> Any:
    # JSON has one number type: 8.0 is the integer 8 (JSON Schema agrees), but strict mode
    # would refuse it. Strings stay refused.
    if isinstance(data, dict):
        fixed = {k: int(v) for k in names if isinstance(v := data.get(k), float) and v.is_integer()}
        if fixed:
            data = {**data, **fixed}
    return data


def _whole(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


# An integer inside a list (token ids): 8.0 is 8 there too, as for protocol.INT_FIELDS.
Integral = Annotated[int, BeforeValidator(_whole)]
_META = ("title", "description", "default", "examples", "deprecated")


def _nullable_optionals(schema: dict[str, Any]) -> None:
    """Say in the JSON schema what `drop_nulls` does: every field that may be left out
    may also be null (its default then applies)."""
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        if name in required or _allows_null(prop):
            continue
        inner = {k: v for k, v in prop.items() if k not in _META}
        meta = {k: v for k, v in prop.items() if k in _META}
        prop.clear()  # in place: the schema dict pydantic hands over is the one it keeps
        prop.update(anyOf=[inner, {"type": "null"}], **meta)


def _allows_null(prop: dict[str, Any]) -> bool:
    branches = prop.get("anyOf", prop.get("oneOf", [prop]))
    return any(b.get("type") == "null" for b in branches)


class Strict(BaseModel):
    """Strict types ("5" is not a number), unknown fields refused, null as absent."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return drop_nulls(data)
