"""Which role switches the conductor refuses (services/conductor/roles.py's `refusal`,
shared by the admin API and the planner): some instance must still take prompts, and
prefill instances must keep a decode instance to hand their KV to. Colocated instances
prefill and decode their own requests, and take no handoff."""

from __future__ import annotations

import pytest

from services.conductor.roles import refusal
from shared.role_messages import EngineRole


def pool(p: int, d: int, c: int = 0) -> dict[str, EngineRole]:
    roles: dict[str, EngineRole] = {f"p{i}": "prefill" for i in range(p)}
    roles |= {f"d{i}": "decode" for i in range(d)}
    return roles | {f"c{i}": "colocated" for i in range(c)}


@pytest.mark.parametrize(
    ("roles", "instance", "to"),
    [
        (pool(2, 1), "p1", "decode"),
        (pool(1, 2), "d1", "prefill"),
        (pool(1, 1), "p0", "colocated"),  # the decode instance idles; nothing is lost
        (pool(2, 1), "p1", "colocated"),
        (pool(1, 1, 1), "c0", "decode"),
        (pool(0, 1, 2), "c1", "prefill"),
        (pool(0, 1, 1), "d0", "colocated"),  # all colocated: the colocated layout
        (pool(0, 0, 2), "c1", "decode"),
    ],
)
def test_allowed(roles: dict[str, EngineRole], instance: str, to: EngineRole) -> None:
    assert refusal(roles, set(), instance, to) == ""


@pytest.mark.parametrize(
    ("roles", "instance", "to", "why"),
    [
        (pool(1, 1), "p0", "decode", "the last prefill instance: switching it would leave none"),
        (pool(1, 1), "d0", "prefill", "the last decode instance: switching it would leave none"),
        (pool(1, 1), "d0", "colocated", "the last decode instance"),
        (pool(0, 1, 1), "c0", "decode", "the last colocated instance"),
        (pool(0, 0, 2), "c0", "prefill", "no decode instance would take its KV"),
        (pool(1, 1), "p0", "prefill", "serves as prefill already"),
        (pool(1, 1), "x", "decode", "no ready prefill, decode or colocated instance x"),
    ],
)
def test_refused(roles: dict[str, EngineRole], instance: str, to: EngineRole, why: str) -> None:
    assert why in refusal(roles, set(), instance, to)


def test_refused_while_switching_and_in_the_colocated_layout() -> None:
    assert "switching already" in refusal(pool(2, 2), {"p0"}, "p0", "decode")
    assert "colocated layout" in refusal(pool(2, 2), set(), "p0", "decode", "colocated")
