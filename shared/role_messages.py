"""Messages of role switching: an engine instance moves between prefill, decode and
colocated in place (services.worker.roles, services.conductor.roles), and a prefill instance whose
decode instance refused the handoff asks the conductor for another.

The same rules as shared.messages: typed, versioned, and bounded where they are parsed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.messages import (
    EngineRole,
    GenerateRequest,
    InstanceId,
    InstanceInfo,
    Message,
    Role,
    Seconds,
)

ENGINE_ROLES: tuple[EngineRole, ...] = ("prefill", "decode", "colocated")


def engine_role(info: InstanceInfo) -> EngineRole | None:
    """The role an engine's heartbeat says it serves as (None: not an engine)."""
    if info.role == Role.DECODE:
        return "decode"
    if info.role == Role.PREFILL:
        return "colocated" if info.colocated else "prefill"
    return None


class RoleChange(Message):
    """Anyone → conductor, request/reply: move an engine instance to another role, in
    place (the admin API, `halfmoon instances set-role`, or the planner). The conductor
    checks it (it must not leave a role empty) and answers with a RoleChangeReply at once;
    the drain and the switch go on in the background."""

    instance_id: InstanceId
    role: EngineRole
    source: Literal["admin", "planner"] = "admin"


class RoleChangeReply(Message):
    switch_id: str = Field(max_length=64)
    instance_id: InstanceId
    from_role: EngineRole
    to_role: EngineRole
    status: Literal["draining"] = "draining"


class SwitchRole(Message):
    """Conductor → engine instance, request/reply: stop intake, finish what you hold, and
    come back as `role` (answered with SwitchDone when that is done, or an error)."""

    switch_id: str = Field(max_length=64)
    role: EngineRole
    drain_timeout_s: Seconds = 300.0


class SwitchDone(Message):
    switch_id: str = Field(max_length=64)
    instance_id: InstanceId
    role: EngineRole  # the role it serves now
    drain_s: Seconds
    detail: str = Field("", max_length=1000)  # what the drain waited for


class Redecode(Message):
    """Prefill → conductor, request/reply: the decode instance named for this request
    refused its handoff (it is switching role, full, or gone); name another. The reply is
    a Placement whose decode_id is the new one."""

    request: GenerateRequest
    exclude: list[InstanceId] = Field(default_factory=list, max_length=64)
