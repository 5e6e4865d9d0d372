"""Wait until the database schema is at the image's newest migration (Alembic head).

The init container of every Halfmoon pod that uses SQL runs this, so that no service starts
on a database the halfmoon-migrate Job (`halfmoon db upgrade`) has not brought up to date:
Kubernetes has no `depends_on`. It only reads; it never migrates. Exits 0 once the
database's revision is the image's head, 1 after SCHEMA_WAIT_S seconds (default 300)
without that (Kubernetes then runs it again, with a backoff).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from shared.db.session import alembic_config, make_engine


async def current_heads(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            heads = await conn.run_sync(
                lambda sync: MigrationContext.configure(sync).get_current_heads()
            )
    finally:
        await engine.dispose()
    return set(heads)


def main() -> int:
    url = os.environ.get("HALFMOON_DATABASE_URL", "")
    wanted = set(ScriptDirectory.from_config(alembic_config(url)).get_heads())
    deadline = time.monotonic() + float(os.environ.get("SCHEMA_WAIT_S", "300"))
    while True:
        try:
            have = asyncio.run(current_heads(url))
            why = f"at {sorted(have) or 'no revision'}, want {sorted(wanted)}"
        except Exception as exc:  # noqa: BLE001 - not reachable yet: wait, and say why
            have, why = set(), f"not reachable ({type(exc).__name__})"
        if have == wanted:
            print(f"database schema is current ({', '.join(sorted(have))})", flush=True)
            return 0
        if time.monotonic() >= deadline:
            print(f"gave up waiting for the database schema: {why}", file=sys.stderr)
            return 1
        print(f"waiting for the halfmoon-migrate Job: database {why}", flush=True)
        time.sleep(3)


if __name__ == "__main__":
    sys.exit(main())
