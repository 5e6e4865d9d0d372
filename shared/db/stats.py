"""Read-side statistics over request records: token-weighted KV hit rates by window."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.db.schema import RequestRecord
from shared.db.session import sessionmaker

WINDOWS_S = (60, 300, 900, 3600)


async def kv_hit_rates(engine: AsyncEngine, now: float | None = None) -> dict[str, Any]:
    """Cached prompt tokens / prompt tokens of completed requests, per prefill instance and
    for the cluster, over sliding windows ending now."""
    now = time.time() if now is None else now
    t = RequestRecord
    out: dict[str, Any] = {}
    async with sessionmaker(engine)() as session:
        for window in WINDOWS_S:
            rows = (
                await session.execute(
                    select(
                        t.prefill_instance,
                        func.sum(t.cached_tokens),
                        func.sum(t.prompt_tokens),
                        func.count(),
                    )
                    .where(t.status == "completed", t.finish_time >= now - window)
                    .group_by(t.prefill_instance)
                )
            ).all()
            per = {inst: _rate(c, p, n) for inst, c, p, n in rows if inst}
            cached = sum(int(c or 0) for _, c, _, _ in rows)
            prompt = sum(int(p or 0) for _, _, p, _ in rows)
            out[f"{window}s"] = {
                "cluster": _rate(cached, prompt, sum(n for *_, n in rows)),
                "instances": per,
            }
    return out


def _rate(cached: int | None, prompt: int | None, n: int) -> dict[str, Any]:
    cached, prompt = int(cached or 0), int(prompt or 0)
    return {
        "hit_rate": cached / prompt if prompt else None,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "requests": n,
    }
