"""`halfmoon instances list|set-role`: the engine instances of a running stack, and a role
switch by hand, through the gateway's admin API (the same checks as the planner's)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Sequence


def _call(url: str, key: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def engines(base: str, key: str) -> list[dict[str, Any]]:
    status, body = _call(f"{base}/admin/state", key)
    if status != 200:
        raise SystemExit(f"halfmoon instances: {base}/admin/state answered {status}: {body}")
    return [i for i in body["instances"] if i["role"] in ("prefill", "decode")]


def role(i: dict[str, Any]) -> str:
    """What an engine serves as: a prefill instance that decodes too says `colocated`."""
    return "colocated" if i.get("colocated") else str(i["role"])


def _line(i: dict[str, Any]) -> str:
    status = i["status"]
    if i.get("switching_to"):
        status += f" -> {i['switching_to']}"
    load = f"running {i['running']:>3}  queued {i['queue_depth']:>3}"
    return f"{i['instance_id']:<48} {role(i):<9} {status:<20} {load}"


def set_role(base: str, key: str, instance_id: str, to: str, wait_s: float) -> int:
    status, body = _call(f"{base}/admin/instances/{instance_id}/role", key, "POST", {"role": to})
    if status != 202:
        message = (body or {}).get("error", {}).get("message", body)
        print(f"halfmoon instances: {message}", file=sys.stderr)
        return 1
    print(f"switch {body['switch_id']}: {instance_id} {body['from_role']} -> {to}, draining")
    deadline = time.monotonic() + wait_s
    while wait_s and time.monotonic() < deadline:
        now = {i["instance_id"]: i for i in engines(base, key)}.get(instance_id)
        if now is not None and role(now) == to and now["status"] == "ready":
            print(f"{instance_id} serves as {to}")
            return 0
        time.sleep(0.5)  # polling a remote state: nothing to wait on but the next look
    if wait_s:
        print(f"halfmoon instances: {instance_id} not serving as {to} after {wait_s:g} s")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon instances")
    p.add_argument("--url", default=os.environ.get("HALFMOON_URL", "http://127.0.0.1:8000"))
    p.add_argument(
        "--admin-key",
        default=os.environ.get("HALFMOON_ADMIN_KEY", ""),
        help="the gateway's admin key, if it has one (env HALFMOON_ADMIN_KEY)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="engine instances: role, status, load")
    sr = sub.add_parser("set-role", help="switch an instance's role in place (drain first)")
    sr.add_argument("instance_id")
    sr.add_argument("role", choices=("prefill", "decode", "colocated"))
    sr.add_argument(
        "--wait", type=float, default=120.0, help="seconds to wait for the switch (0: none)"
    )
    args = p.parse_args(argv)
    base = args.url.rstrip("/")
    if args.cmd == "list":
        for i in engines(base, args.admin_key):
            print(_line(i))
        return 0
    return set_role(base, args.admin_key, args.instance_id, args.role, args.wait)
