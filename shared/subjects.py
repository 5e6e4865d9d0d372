"""Every NATS subject Halfmoon uses, in one place.

Per-instance subjects carry the instance id; many instances of a role share
role-wide work through queue groups (QUEUE_*).
"""

from __future__ import annotations

PREFIX = "halfmoon"

# Conductor: the gateway asks it to place (and dispatch) a request.
CONDUCTOR_SCHEDULE = f"{PREFIX}.conductor.schedule"
CONDUCTOR_QUEUE = "conductor"

# Heartbeats: every service publishes its InstanceInfo here (role and id in the subject).
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"

# Role switches: anyone asks the conductor (RoleChange); it tells the instance (SwitchRole).
CONDUCTOR_ROLE = f"{PREFIX}.conductor.role"
# A prefill whose decode refused a handoff asks for another decode instance (Redecode).
CONDUCTOR_REDECODE = f"{PREFIX}.conductor.redecode"
# KV events (block stored / removed / cleared) from prefill and decode instances.
KV_EVENTS = f"{PREFIX}.kv.events"
KV_MATCH = f"{PREFIX}.kv.match"
KVMANAGER_QUEUE = "kvmanager"

# Cancellation is broadcast: whoever holds the request drops it.
CANCEL = f"{PREFIX}.cancel"


def heartbeat(role: str, instance_id: str) -> str:
    return f"{PREFIX}.heartbeat.{role}.{instance_id}"


def prefill_submit(instance_id: str) -> str:
    return f"{PREFIX}.prefill.{instance_id}.submit"


def prefill_stage(instance_id: str) -> str:
    """Request/reply: run a stage of a pipelined prefill (StageJob)."""
    return f"{PREFIX}.prefill.{instance_id}.stage"


def prefill_stage_close(instance_id: str) -> str:
    """Request/reply: drop a stage opened for a group that did not form (StageClose)."""
    return f"{PREFIX}.prefill.{instance_id}.stage_close"


def prefill_hop(instance_id: str) -> str:
    """Request/reply: a pipelined prefill's next chunk of hidden states (StageHop)."""
    return f"{PREFIX}.prefill.{instance_id}.hop"


def prefill_replicate(instance_id: str) -> str:
    """Publish: copy a hot prefix here ahead of demand (KVReplicate)."""
    return f"{PREFIX}.prefill.{instance_id}.replicate"


def decode_submit(instance_id: str) -> str:
    return f"{PREFIX}.decode.{instance_id}.submit"


def decode_stream(instance_id: str) -> str:
    """Request/reply: a long prompt's KV chunk, streamed to decode while prefill runs
    (into the blocks its KVHold reserved)."""
    return f"{PREFIX}.decode.{instance_id}.stream"


def decode_hold(instance_id: str) -> str:
    """Request/reply: pin what decode holds of a prompt before its KV is offered (KVHold)."""
    return f"{PREFIX}.decode.{instance_id}.hold"


def kv_export(instance_id: str) -> str:
    """Request/reply: offer cached prefix blocks for a pull by another instance."""
    return f"{PREFIX}.kv.{instance_id}.export"


def tokens(request_id: str) -> str:
    """Per-request token stream: prefill publishes the first token, decode the rest."""
    return f"{PREFIX}.tokens.{request_id}"


def instance_role(instance_id: str) -> str:
    """Request/reply: switch this engine instance's role in place (SwitchRole)."""
    return f"{PREFIX}.instance.{instance_id}.role"
