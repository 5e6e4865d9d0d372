"""`halfmoon keys create|list|revoke`: API keys in SQL (the gateway checks them when
started with --require-api-key). A new key's secret is printed once and never stored."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Sequence

from services.gateway import keys
from shared.db import session as db


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfmoon keys", description=__doc__)
    parser.add_argument(
        "--database-url",
        default=None,
        help="[env HALFMOON_DATABASE_URL; default SQLite in HALFMOON_HOME]",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    create = sub.add_parser("create", help="mint a key and print it (once)")
    create.add_argument(
        "--tenant", required=True, help="tenant name: its prefix cache is shared by its keys only"
    )
    create.add_argument("--name", default="", help="a label for `keys list`")
    create.add_argument(
        "--rate-limit",
        default="",
        help="e.g. 60/minute or 5/second;1000/day (empty: the gateway's default)",
    )
    create.add_argument(
        "--admin", action="store_true", help="an admin key: /admin/* only, no /v1/*"
    )
    lst = sub.add_parser("list", help="list keys (never their secrets)")
    lst.add_argument("--all", action="store_true", help="include revoked keys")
    revoke = sub.add_parser(
        "revoke", help="revoke a key by id (takes effect within the gateway's --key-cache-s)"
    )
    revoke.add_argument("key_id")
    init = sub.add_parser(
        "init-admin",
        help="make the admin key file once (the gateway's and "
        "console's --admin-key-file) and print the key that once; later "
        "runs keep it and print nothing secret",
    )
    init.add_argument("--file", required=True, help="where the key is kept (created 0600)")
    return parser


def init_admin(path: str) -> int:
    """First start: a new admin key, printed once. Later starts: the kept one, unprinted."""
    secret = keys.create_key_file(path)
    if secret is None:
        keys.read_key_file(path)  # still usable? (else a clear error, not a 401 later)
        print(f"the admin key is kept in {path} (it was printed when it was made)")
        return 0
    print(f"a new admin key, kept in {path}; it is shown this once:")
    print(secret)
    return 0


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


async def _run(args: argparse.Namespace, url: str) -> int:
    engine = db.make_engine(url)
    try:
        if args.cmd == "create":
            secret, row = await keys.create_key(
                engine, args.tenant, name=args.name, admin=args.admin, rate_limit=args.rate_limit
            )
            print(
                f"created {row.id} for tenant {row.tenant!r}"
                f"{' (admin)' if row.admin else ''}; the key, shown this once:"
            )
            print(secret)
            return 0
        if args.cmd == "list":
            rows = await keys.list_keys(engine, include_revoked=args.all)
            print(
                f"{'id':<22} {'prefix':<11} {'tenant':<16} {'kind':<6} {'rate limit':<16} "
                f"{'created':<20} {'revoked':<20} name"
            )
            for r in rows:
                print(
                    f"{r.id:<22} {r.prefix:<11} {r.tenant:<16} "
                    f"{'admin' if r.admin else 'tenant':<6} {r.rate_limit or '-':<16} "
                    f"{_when(r.created):<20} {_when(r.revoked):<20} {r.name}"
                )
            return 0
        if await keys.revoke_key(engine, args.key_id):
            print(f"revoked {args.key_id}")
            return 0
        print(f"halfmoon keys: no live key {args.key_id!r}", file=sys.stderr)
        return 1
    finally:
        await engine.dispose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cmd == "init-admin":  # a file, no SQL: compose runs it before the database is up
        try:
            return init_admin(args.file)
        except (OSError, ValueError) as exc:
            print(f"halfmoon keys init-admin: {exc}", file=sys.stderr)
            return 1
    url = args.database_url or os.environ.get("HALFMOON_DATABASE_URL", "")
    if args.cmd == "create":
        try:
            keys.check_tenant(args.tenant)
            keys.parse_rate_limit(args.rate_limit)
        except ValueError as exc:
            parser.error(str(exc))
    db.upgrade(url)  # as `halfmoon up` does: the table exists before the first key
    return asyncio.run(_run(args, url))


if __name__ == "__main__":
    raise SystemExit(main())
