"""How a prefix split by layers among a pipelined prefill's group is named in the KV index:
one holder id for the group (its members and their layer ranges), which its stages publish
their blocks under and the conductor reads back (pure)."""

from __future__ import annotations

from collections.abc import Collection

GROUP = "group:"  # the start of a group's holder id in the KV index


def group_holder(stages: list[tuple[str, tuple[int, int]]]) -> str:
    """The KV index's holder id for a prefix split among a group's stages by layer range,
    e.g. "group:p00@0-40,p01@40-80"."""
    return GROUP + ",".join(f"{i}@{a}-{b}" for i, (a, b) in stages)


def group_members(holder: str) -> list[tuple[str, tuple[int, int]]] | None:
    """The stages a group holder id names, in order; None for a single instance's id."""
    if not holder.startswith(GROUP):
        return None
    out = []
    for part in holder[len(GROUP) :].split(","):
        instance_id, _, layers = part.rpartition("@")
        first, _, end = layers.partition("-")
        out.append((instance_id, (int(first), int(end))))
    return out


def holder_alive(holder: str, live: Collection[str]) -> bool:
    """An instance among `live`, or a group all of whose members are."""
    members = group_members(holder)
    if members is None:
        return holder in live
    return all(instance_id in live for instance_id, _ in members)


def groups_with(holders: Collection[str], instance_id: str) -> list[str]:
    """The group holder ids among `holders` that `instance_id` is a stage of."""
    return [
        h for h in holders if any(member == instance_id for member, _ in group_members(h) or [])
    ]
