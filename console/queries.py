"""Read-only data for the console: SQL snapshots and the metrics derived from them.
(Settings: console/settings.py; benchmark reports: console/reports.py.)

Everything here is plain Python over plain dicts so it can be tested without Streamlit.
SQL runs through SQLAlchemy async; Streamlit runs the app as a synchronous script, so each
batch of queries gets its own event loop and its own engine (an async engine is bound to
the loop that created it, and a console refreshes every few seconds, so the cost is small).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine, Iterable, TypeVar

from sqlalchemy import inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection

from console import history, planner
from shared.db.schema import InstanceRecord, ReplicationRecord, RequestRecord, RequestStatus
from shared.db.session import make_engine, resolve_url
from shared.hashing import from_signed

DB_TIMEOUT_S = 10.0  # a blackholed database host must not hang the page for a minute
STATUSES = [s.value for s in RequestStatus]
MAX_ROWS = 50_000  # newest first; the console is for operations, not for archives
MAX_REPLICATIONS = 10_000  # newest first, in the window
WINDOWS: dict[str, float | None] = {
    "last 5 min": 300.0,
    "last 1 h": 3600.0,
    "last 24 h": 86400.0,
    "all": None,
}


class DatabaseUnavailable(Exception):
    """The database cannot be read; the message is meant for a human."""


@dataclass
class Snapshot:
    """What one refresh reads from SQL."""

    now: float
    requests: list[dict[str, Any]] = field(default_factory=list)  # newest first
    instances: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False  # more than MAX_ROWS requests in the window
    samples: list[dict[str, Any]] = field(default_factory=list)  # load samples, oldest first
    kv_tiers: list[dict[str, Any]] = field(default_factory=list)  # blocks per instance, tier
    hot_blocks: list[dict[str, Any]] = field(default_factory=list)  # most hit first
    # Hot-prefix replications in the window, newest first (prefix_hash unsigned); None: the
    # database has no kv_replications table (migration 0008 has not run).
    replications: list[dict[str, Any]] | None = None


# -- SQL ------------------------------------------------------------------------------
def safe_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a malformed URL is shown as the user typed it
        return url


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return f"no answer within {DB_TIMEOUT_S:.0f} s"
    inner = getattr(exc, "orig", None) or exc
    text = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    missing = ("no such table", "no such column", "does not exist")
    hint = (
        " (have the migrations run? `halfmoon up` runs them)"
        if any(m in text for m in missing)
        else ""
    )
    return f"{type(inner).__name__}: {text}"[:300] + hint


def _check_sqlite_file(url: str) -> None:
    # Connecting would create an empty file; a read-only console should say "missing" instead.
    prefix = "sqlite+aiosqlite:///"
    if url.startswith(prefix):
        path = url[len(prefix) :].split("?", 1)[0]
        if path and path != ":memory:" and not Path(path).expanduser().exists():
            raise DatabaseUnavailable(f"no SQLite database at {path}")


T = TypeVar("T")
# What a snapshot runs on its connection: read(conn) -> coroutine.
Read = Callable[[AsyncConnection], Awaitable[T]]


async def _connected(url: str, read: Read[T]) -> T:
    """await read(conn) on a fresh engine (bound to this event loop), disposed afterwards;
    past DB_TIMEOUT_S it raises TimeoutError."""
    engine = make_engine(url)
    try:
        async with asyncio.timeout(DB_TIMEOUT_S), engine.connect() as conn:
            return await read(conn)
    finally:
        await engine.dispose()


def _schema(sync_conn: Any) -> tuple[set[str], bool]:
    """(the requests table's columns, whether kv_replications exists) in this database."""
    found = inspect(sync_conn)
    columns = {col["name"] for col in found.get_columns(RequestRecord.__tablename__)}
    return columns, found.has_table(ReplicationRecord.__tablename__)


async def read_replications(conn: AsyncConnection, since: float | None) -> list[dict[str, Any]]:
    """The window's replications, newest first (MAX_REPLICATIONS at most), with the prefix
    hash back in its unsigned form."""
    t = ReplicationRecord.__table__
    query = select(t).order_by(t.c.created.desc(), t.c.id.desc()).limit(MAX_REPLICATIONS)
    if since is not None:
        query = query.where(t.c.created >= since)
    rows = [dict(r._mapping) for r in await conn.execute(query)]
    return [{**r, "prefix_hash": int(from_signed(r["prefix_hash"]))} for r in rows]


async def _read(conn: AsyncConnection, since: float | None, now: float) -> Snapshot:
    t = RequestRecord.__table__
    # The columns and tables this database has: what a later migration adds is left out
    # until it runs.
    have, replicated = await conn.run_sync(_schema)
    columns = [c for c in t.columns if c.name in have]
    query = select(*columns).order_by(t.c.arrival_time.desc()).limit(MAX_ROWS + 1)
    if since is not None:
        query = query.where(t.c.arrival_time >= since)
    requests = [dict(r._mapping) for r in await conn.execute(query)]
    instances = [dict(r._mapping) for r in await conn.execute(select(InstanceRecord.__table__))]
    samples = await history.read_samples(conn, since)
    kv_tiers, hot_blocks = await history.read_kv(conn)
    replications = await read_replications(conn, since) if replicated else None
    return Snapshot(
        now=now,
        requests=requests[:MAX_ROWS],
        instances=instances,
        truncated=len(requests) > MAX_ROWS,
        samples=samples,
        kv_tiers=kv_tiers,
        hot_blocks=hot_blocks,
        replications=replications,
    )


def _run_sync(coro_factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """asyncio.run, or the same in a worker thread if this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_factory())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(coro_factory())).result()


def _guarded(url: str, read: Read[T]) -> T:
    """read(conn) -> coroutine, run with a deadline; any failure is one clear message."""
    try:
        url = resolve_url(url)
        _check_sqlite_file(url)
        return _run_sync(lambda: _connected(url, read))
    except DatabaseUnavailable:
        raise
    except Exception as exc:  # any driver error becomes one clear message
        raise DatabaseUnavailable(f"{safe_url(url)}: {_describe(exc)}") from exc


def load_snapshot(url: str, window_s: float | None, now: float | None = None) -> Snapshot:
    """Requests that arrived in the window (newest first), every instance row, the load
    samples of the window and what the KV cache holds."""
    now = time.time() if now is None else now
    since = None if window_s is None else now - window_s
    return _guarded(url, lambda conn: _read(conn, since, now))


def load_decision(url: str, request_id: str) -> dict[str, Any] | None:
    """The conductor's recorded reasons for one request (None: nothing recorded)."""
    return _guarded(url, lambda conn: history.read_decision(conn, request_id))


def load_planner(url: str, window_s: float | None, now: float | None = None) -> planner.PlannerData:
    """The planner's decisions and the role switches of the window (console.planner)."""
    now = time.time() if now is None else now
    since = None if window_s is None else now - window_s
    return _guarded(url, lambda conn: planner.read_planner(conn, since, now))


# -- derived metrics --------------------------------------------------------------------
def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def tbt_ms(row: dict[str, Any]) -> float | None:
    """Mean gap between output tokens after the first: the best SQL alone can say about TBT."""
    first, finish = row.get("first_token_time"), row.get("finish_time")
    n = row.get("completion_tokens") or 0
    if first is None or finish is None or n < 2:
        return None
    return 1000.0 * (finish - first) / (n - 1)


def hit_rate(rows: Iterable[dict[str, Any]]) -> float | None:
    """Token-weighted: sum cached / sum prompt over completed requests.

    Only completed requests count: usage (and so cached_tokens) is reported at the finish,
    and a rejected request never reached a prefill instance, so either would dilute it.
    """
    done = [r for r in rows if r.get("status") == "completed"]
    prompt = sum(r.get("prompt_tokens") or 0 for r in done)
    return None if prompt == 0 else sum(r.get("cached_tokens") or 0 for r in done) / prompt


def overview(
    rows: list[dict[str, Any]], now: float, window_s: float | None, slo_ms: float
) -> dict[str, Any]:
    """The Overview page's numbers. Rates are over the window ("all": since the first arrival)."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    span = (
        window_s
        if window_s is not None
        else (max(now - min(r["arrival_time"] for r in rows), 1.0) if rows else 1.0)
    )
    completed = [r for r in rows if r["status"] == "completed"]
    # Cancelled requests are the client's choice, so they count neither for nor against the SLO.
    judged = [r for r in rows if r["status"] in ("completed", "failed", "rejected")]
    met = sum(1 for r in completed if r.get("ttft_ms") is not None and r["ttft_ms"] <= slo_ms)
    ttft = [r.get("ttft_ms") for r in completed]
    e2e = [r.get("e2e_ms") for r in completed]
    tbt = [tbt_ms(r) for r in completed]
    return {
        "requests": len(rows),
        "counts": counts,
        "requests_per_s": len(rows) / span,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "tbt_p50_ms": percentile(tbt, 50),
        "tbt_p99_ms": percentile(tbt, 99),
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "slo_attainment": met / len(judged) if judged else None,
        "rejection_rate": counts.get("rejected", 0) / len(rows) if rows else None,
        "hit_rate": hit_rate(rows),
    }


def time_range(
    window_s: float | None, rows: list[dict[str, Any]], now: float, key: str = "arrival_time"
) -> tuple[float, float]:
    """The x axis of time charts: the whole window ("all": from the first row's `key`), up to
    now, with a little room on both sides so that edge buckets are not cut in half."""
    if window_s is not None:
        start = now - window_s
    else:
        start = min(r[key] for r in rows) if rows else now - 3600.0
    pad = 0.02 * max(now - start, 1.0)
    return start - pad, now + pad


def bucket_seconds(
    window_s: float | None,
    rows: list[dict[str, Any]],
    now: float,
    key: str = "arrival_time",
    finest: float = 1.0,
) -> float:
    """About 60 buckets per window ("all": from the first row's `key`), rounded to a readable
    size and never under `finest` seconds."""
    if window_s is not None:
        span = window_s
    else:
        span = now - min(r[key] for r in rows) if rows else 3600.0
    for size in (1, 5, 10, 30, 60, 300, 600, 900, 1800, 3600, 21600, 86400):
        if size >= finest and span / size <= 60:
            return float(size)
    return 86400.0 * 7


def _buckets(
    rows: list[dict[str, Any]], bucket_s: float, key: str = "arrival_time"
) -> dict[float, list[dict[str, Any]]]:
    groups: dict[float, list[dict[str, Any]]] = {}
    for r in rows:
        start = math.floor(r[key] / bucket_s) * bucket_s
        groups.setdefault(start, []).append(r)
    return dict(sorted(groups.items()))


def status_series(rows: list[dict[str, Any]], bucket_s: float) -> dict[str, Any]:
    """Requests per bucket (by arrival), one count list per status."""
    groups = _buckets(rows, bucket_s)
    statuses = sorted({r["status"] for r in rows})
    return {
        "t": list(groups),
        "by_status": {
            s: [sum(1 for r in g if r["status"] == s) for g in groups.values()] for s in statuses
        },
    }


def ttft_series(rows: list[dict[str, Any]], bucket_s: float) -> dict[str, Any]:
    groups = _buckets([r for r in rows if r.get("ttft_ms") is not None], bucket_s)
    return {
        "t": list(groups),
        "p50": [percentile([r["ttft_ms"] for r in g], 50) for g in groups.values()],
        "p99": [percentile([r["ttft_ms"] for r in g], 99) for g in groups.values()],
    }


def hit_rate_series(rows: list[dict[str, Any]], bucket_s: float) -> dict[str, Any]:
    """Token-weighted hit rate per bucket: the cluster and each prefill instance."""
    done = [r for r in rows if r.get("status") == "completed"]
    groups = _buckets(done, bucket_s)
    names = sorted({r["prefill_instance"] for r in done if r.get("prefill_instance")})
    return {
        "t": list(groups),
        "cluster": [hit_rate(g) for g in groups.values()],
        "per_instance": {
            n: [hit_rate([r for r in g if r.get("prefill_instance") == n]) for g in groups.values()]
            for n in names
        },
    }


def replication_series(rows: list[dict[str, Any]], bucket_s: float) -> dict[str, Any]:
    """Bytes replicated per bucket (by `created`), one list per target instance."""
    groups = _buckets(rows, bucket_s, key="created")
    targets = sorted({r["target"] for r in rows})
    return {
        "t": list(groups),
        "by_target": {
            n: [sum(r["nbytes"] for r in g if r["target"] == n) for g in groups.values()]
            for n in targets
        },
    }


def replication_rows(rows: list[dict[str, Any]], limit: int = 200) -> list[dict[str, Any]]:
    """The table of the newest `limit` replications (rows newest first, as read)."""
    return [
        {
            "time": r["created"],
            "prefix": f"{r['prefix_hash']:016x}",
            "blocks": r["blocks"],
            "MiB": r["nbytes"] / 2**20,
            "copy": f"{r['source']} → {r['target']}",
            "heat_rps": r["heat_rps"],
            "holders": r["holders"],
            "reason": r["reason"],
        }
        for r in rows[:limit]
    ]


def filter_requests(
    rows: list[dict[str, Any]], statuses: Iterable[str] | None = None, instance: str | None = None
) -> list[dict[str, Any]]:
    """Rows with one of `statuses` (None: any) that ran on `instance` (None: any)."""
    wanted = set(statuses) if statuses is not None else None
    return [
        r
        for r in rows
        if (wanted is None or r["status"] in wanted)
        and (instance is None or instance in (r.get("prefill_instance"), r.get("decode_instance")))
    ]


def request_timeline(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A request's phases as (label, start_ms, end_ms) from its arrival: only the boundaries
    the gateway measured (placement reply, first token, first decode-side token, finish)."""
    arrival, first = row["arrival_time"], row.get("first_token_time")
    finish, dispatch = row.get("finish_time"), row.get("dispatch_time")
    handoff = row.get("decode_first_token_time")
    ms = lambda t: 1000.0 * (t - arrival)  # noqa: E731
    phases = []
    if dispatch is not None:
        phases.append({"phase": "placement (conductor)", "start_ms": 0.0, "end_ms": ms(dispatch)})
    if first is None:
        start = dispatch if dispatch is not None else arrival
        end = finish if finish is not None else start
        label = "prefill queue → " if dispatch is not None else "arrival → "
        return phases + [{"phase": label + row["status"], "start_ms": ms(start), "end_ms": ms(end)}]
    if dispatch is not None:
        phases.append(
            {"phase": "prefill queue + prefill", "start_ms": ms(dispatch), "end_ms": ms(first)}
        )
    else:
        phases.append({"phase": "queue + prefill (TTFT)", "start_ms": 0.0, "end_ms": ms(first)})
    if handoff is not None:
        phases.append(
            {
                "phase": "KV transfer + decode admission",
                "start_ms": ms(first),
                "end_ms": ms(handoff),
            }
        )
    if finish is not None:
        phases.append({"phase": "decode", "start_ms": ms(handoff or first), "end_ms": ms(finish)})
    return phases
