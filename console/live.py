"""Live cluster state from the gateway's admin JSON, and pool rows from either source.

The gateway knows every instance's last heartbeat to the second; SQL only has what the
conductor wrote (every few seconds, and "dead" once it gave up on an instance). The Pools
page prefers the gateway and falls back to SQL, so both become the same row shape here.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

DEAD_AFTER_S = 3.0  # heartbeats come every second; three missed ones mean dead
# The conductor refreshes SQL rows every 5 s; a row three refreshes old has lost its writer.
SQL_STALE_AFTER_S = 15.0
POOL_ROLES = ("prefill", "decode")
# Fields shown in fixed columns, or too noisy for the table.
_KNOWN = {
    "instance_id",
    "id",
    "role",
    "status",
    "heartbeat_age_s",
    "queue_depth",
    "running",
    "kv_tokens_used",
    "v",
    "pid",
    "host",
    "kv_host",
    "kv_port",
    "started_at",
    "sent_at",
    "last_heartbeat",
    "info",
    "model",
}


class ClusterUnavailable(Exception):
    """The gateway's admin endpoint did not answer with its state."""


def admin_url(gateway_url: str) -> str:
    return gateway_url.rstrip("/") + "/admin/state"


def fetch_state(gateway_url: str, timeout_s: float = 1.5, admin_key: str = "") -> dict[str, Any]:
    """GET /admin/state; any failure becomes ClusterUnavailable with a short reason."""
    request = urllib.request.Request(admin_url(gateway_url))
    if admin_key:  # the gateway guards /admin/* when API keys are on
        request.add_header("Authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            state = json.loads(reply.read())
    except urllib.error.URLError as exc:
        raise ClusterUnavailable(str(getattr(exc, "reason", exc))) from exc
    except (OSError, ValueError) as exc:  # timeouts, resets, a reply that is not JSON
        raise ClusterUnavailable(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("instances"), list):
        raise ClusterUnavailable("the reply has no instance list")
    return state


def _number(value: Any, default: float = 0.0) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return out if math.isfinite(out) else default


def _extras(fields: dict[str, Any]) -> dict[str, Any]:
    """Fields newer gateways add (KV blocks per tier, hit rates...), if they are scalars."""
    return {
        k: v
        for k, v in fields.items()
        if k not in _KNOWN and (isinstance(v, (str, int, float, bool)) or v is None)
    }


def _row(
    instance: str, role: str, status: str, age: float | None, fields: dict[str, Any], alive: bool
) -> dict[str, Any]:
    return {
        "instance": instance,
        "role": role,
        "health": "alive" if alive else "DEAD",
        "status": status,
        "heartbeat_age_s": None if age is None else round(age, 1),
        "queue_depth": int(_number(fields.get("queue_depth"))),
        "running": int(_number(fields.get("running"))),
        "kv_tokens_used": int(_number(fields.get("kv_tokens_used"))),
        **_extras(fields),
    }


def _sorted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (POOL_ROLES.index(r["role"]), r["instance"]))


def pool_from_live(state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for inst in state.get("instances") or []:
        if not isinstance(inst, dict) or inst.get("role") not in POOL_ROLES:
            continue
        age = _number(inst.get("heartbeat_age_s"), math.inf)
        alive = age <= DEAD_AFTER_S and inst.get("status") != "dead"
        name, status = str(inst.get("instance_id", "?")), str(inst.get("status", ""))
        rows.append(_row(name, inst["role"], status, None if math.isinf(age) else age, inst, alive))
    return _sorted(rows)


def pool_from_sql(instances: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    rows = []
    for inst in instances:
        if inst.get("role") not in POOL_ROLES:
            continue
        raw = inst.get("info")
        info: dict[str, Any] = raw if isinstance(raw, dict) else {}
        age = now - _number(inst.get("last_heartbeat"), now)
        alive = inst.get("status") != "dead" and age <= SQL_STALE_AFTER_S
        rows.append(
            _row(str(inst["id"]), inst["role"], str(inst.get("status", "")), age, info, alive)
        )
    return _sorted(rows)
