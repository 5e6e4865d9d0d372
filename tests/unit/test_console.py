"""Console: pure queries and charts, then the app through Streamlit's AppTest over a SQLite
database seeded by the real write paths (Alembic; RecordWriter for requests; the conductor's
heartbeat hook for instance rows, load samples and decisions; the KV manager's handlers for
kv_blocks; RecordWriter.replication for the hot-prefix replications), then `serve` for
real."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from console import charts, history, live, queries, reports, serve
from services.conductor.args import ConductorSettings
from services.conductor.handlers import Conductor
from services.conductor.policy import Candidate, Decision
from services.kvmanager.handlers import KVManager
from shared.db.kv_records import KVBlockWriter
from shared.db.load_samples import LoadSampler
from shared.db.records import RecordWriter
from shared.db.session import make_engine, upgrade
from shared.kv_messages import KVMatchReply, KVMatchRequest
from shared.messages import (
    GenerateRequest,
    InstanceInfo,
    KVActivity,
    KVEvent,
    KVEventKind,
    Role,
    SamplingParams,
)
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "console" / "app.py")
NOW = time.time()
UNREACHABLE_GATEWAY = "http://127.0.0.1:9"
# id: (status, arrival offset s, prefill, decode, prompt, cached, completion, ttft ms, e2e ms)
SEED = {
    "r1": ("completed", -100, "prefill-0", "decode-0", 1000, 512, 11, 100.0, 600.0),
    "r2": ("completed", -90, "prefill-0", "decode-0", 1000, 0, 5, 300.0, 700.0),
    "r3": ("completed", -80, "prefill-1", "decode-0", 2048, 1536, 3, 2500.0, 2900.0),
    "r4": ("failed", -70, "prefill-1", "decode-1", 500, 0, 0, None, None),
    "r5": ("rejected", -60, None, None, 800, 0, 0, None, None),
    "old": ("completed", -7200, "prefill-0", "decode-0", 100, 100, 2, 50.0, 80.0),
}
ERRORS = {"failed": "decode-1 stopped", "rejected": "TTFT SLO cannot be met"}  # error column
# Phase boundaries the gateway measured for r3 (s after arrival): placement reply, first
# decode-side token. Its first token is at 2.5 s and it finished at 2.9 s.
PHASES = {"r3": {"dispatch_time": 0.2, "decode_first_token_time": 2.6}}
MIB = 2**20
# Heartbeats every 5 s from -60 s to -10 s (11 samples). Gauges are constant per instance,
# so a bucket's mean is that constant whatever the bucket size; counters grow by `step`
# per heartbeat. prefill-0 and decode-0 started long ago, so their first sample's activity is
# unknown (NULL) and 10 deltas count; prefill-1 started 2 s before its first heartbeat, so
# all its counters count. (queue, running, blocks total, free, disk used, disk free)
HEARTBEATS = {
    "prefill-0": (
        -600,
        range(-60, -5, 5),
        (2, 1, 100, 60, 0, 0),
        {"blocks_stored": 10, "blocks_evicted": 2, "transfers_out": 1, "bytes_out": MIB},
    ),
    "decode-0": (
        -600,
        range(-60, -5, 5),
        (0, 4, 200, 50, 0, 0),
        {"transfers_in": 1, "bytes_in": MIB},
    ),
    "prefill-1": (
        -32,
        range(-30, -5, 5),
        (0, 3, 100, 90, 3, 97),
        {"blocks_stored": 2, "disk_stored": 1},
    ),
}
# Expected totals over the window: prefill-0 10 x 10 stored, 2 x 10 evicted, 10 transfers
# out; decode-0 10 transfers in (10 MiB); prefill-1 5 heartbeats x 2 stored, 5 to disk.
TOTALS = {
    "blocks_stored": 100 + 10,
    "blocks_evicted": 20,
    "transfers_in": 10,
    "transfers_out": 10,
    "bytes_in": 10 * MIB,
    "disk_stored": 5,
}
H1, H2, H3, H4 = 0xA1, 0xB2, 0xC3, 0xD4  # block hashes (chained in real life)
HOUR_HIT = (512 + 1536) / (1000 + 1000 + 2048)  # completed requests of the last hour
# Hot-prefix replications the conductor ordered: (offset s, prefix hash, blocks, MiB, source,
# target, heat req/s, holders). The big hash is past 2**63 (stored signed, shown unsigned).
BIG = 0xFEDC_BA98_7654_3210
REPLICATIONS = [
    (-7000, H1, 1, 1, "prefill-0", "prefill-1", 3.0, 1),  # outside the last hour
    (-50, H3, 3, 12, "prefill-0", "prefill-1", 6.5, 1),
    (-20, BIG, 8, 32, "prefill-1", "prefill-0", 2.25, 2),
]
ALL_HIT = (512 + 1536 + 100) / (1000 + 1000 + 2048 + 100)


def _row(rid, status, offset, prefill, decode, prompt, cached, completion, ttft, e2e):
    arrival = NOW + offset
    return {
        "id": rid,
        "status": status,
        "arrival_time": arrival,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "ttft_ms": ttft,
        "e2e_ms": e2e,
        "prefill_instance": prefill,
        "decode_instance": decode,
        "first_token_time": None if ttft is None else arrival + ttft / 1000,
        "finish_time": arrival + (e2e or 5) / 1000,
    }


ROWS = [_row(rid, *values) for rid, values in SEED.items()]


def _shifted(row: dict) -> dict:
    """The rows as of now: the app compares with the real clock, and the module may have been
    imported minutes ago (a long test session) — heartbeats must look fresh."""
    shift = time.time() - NOW
    out = dict(row)
    for key in ("arrival_time", "first_token_time", "finish_time"):
        if out[key] is not None:
            out[key] += shift
    return out


async def _seed(url: str) -> None:
    engine = make_engine(url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    now = time.time()
    rows = [_shifted(r) for r in ROWS]
    for r in rows:
        writer.request_accepted(
            id=r["id"],
            model="m",
            status="queued",
            arrival_time=r["arrival_time"],
            prompt_tokens=r["prompt_tokens"],
        )
        if r["prefill_instance"]:
            writer.request_update(
                r["id"],
                status="running",
                prefill_instance=r["prefill_instance"],
                decode_instance=r["decode_instance"],
            )
    await writer.flush()  # accepted before finished, as the gateway writes them
    for r in rows:
        done = {
            k: r[k]
            for k in (
                "first_token_time",
                "finish_time",
                "completion_tokens",
                "cached_tokens",
                "ttft_ms",
                "e2e_ms",
            )
        }
        reason = "stop" if r["status"] == "completed" else None
        phases = {k: r["arrival_time"] + v for k, v in PHASES.get(r["id"], {}).items()}
        writer.request_finished(
            r["id"],
            r["status"],
            error=ERRORS.get(r["status"]),
            finish_reason=reason,
            **done,
            **phases,
        )
    await _heartbeats(writer, now)
    await _kv_blocks(engine, now)
    _replications(writer, now)
    for iid, queue, running in [
        ("prefill-0", 2, 1),
        ("prefill-1", 0, 3),
        ("decode-0", 0, 4),
        ("decode-1", 1, 0),
        ("conductor-0", 0, 0),
    ]:
        writer.instance_seen(
            id=iid,
            role=iid.split("-")[0],
            host="127.0.0.1",
            status="ready",
            started_at=now - 600,
            last_heartbeat=now,
            info={"queue_depth": queue, "running": running, "kv_tokens_used": 1000 * running},
        )
    await writer.flush()
    writer.instance_seen(id="decode-1", status="dead")  # as the conductor's sweep writes it
    await writer.close()
    await engine.dispose()


def _conductor(writer: RecordWriter) -> Conductor:
    return Conductor(ConductorSettings(), nc=None, records=writer)  # type: ignore[arg-type]


async def _heartbeats(writer: RecordWriter, now: float) -> None:
    """Load samples and decisions as the conductor writes them, at chosen clock readings."""
    conductor = _conductor(writer)
    old = InstanceInfo(instance_id="prefill-gone", role=Role.PREFILL, started_at=now - 200_000)
    writer.load_sample(old, now - 30 * 3600, 5.0, 24 * 3600.0)  # pruned: retention is 24 h
    for iid, (started, offsets, gauges, step) in HEARTBEATS.items():
        queue, running, total, free, disk_used, disk_free = gauges
        for k, offset in enumerate(offsets, start=1):
            activity = KVActivity(**{key: k * n for key, n in step.items()})
            info = InstanceInfo(
                instance_id=iid,
                role=iid.split("-")[0],
                started_at=now + started,
                queue_depth=queue,
                running=running,
                kv_blocks_total=total,
                kv_blocks_free=free,
                disk_blocks_used=disk_used,
                disk_blocks_free=disk_free,
                kv_activity=activity,
            )
            conductor._record_instance(info, now + offset, "ready")
            conductor._record_instance(info, now + offset, "ready")  # same interval: no row
    r3, r5 = (_shifted(r) for r in ROWS if r["id"] in ("r3", "r5"))
    busy = Candidate("prefill-0", 0, "", 0.0, 1.5, 1.8)
    cached = Candidate("prefill-1", 96, "", 0.0, 0.4, 2.0)
    conductor._record(
        _request("r3", r3),
        Decision("kvcentric", cached, "decode-0", 0.02, [busy, cached]),
        r3["arrival_time"],
    )
    conductor._record(
        _request("r5", r5),
        Decision("kvcentric", cached, "decode-0", 0.02, [busy, cached], ERRORS["rejected"]),
        r5["arrival_time"],
    )
    await writer.flush()


def _replications(writer: RecordWriter, now: float) -> None:
    """Hot-prefix replications as the conductor records them."""
    for offset, h, blocks, mib, source, target, heat, holders in REPLICATIONS:
        writer.replication(
            created=now + offset,
            prefix_hash=h,
            blocks=blocks,
            nbytes=mib * MIB,
            source=source,
            target=target,
            heat_rps=heat,
            holders=holders,
            reason=f"{heat} req/s on {holders} holder(s)",
        )


def _request(rid: str, row: dict) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="m",
        prompt_token_ids=[1] * row["prompt_tokens"],
        sampling=SamplingParams(),
        arrival_time=row["arrival_time"],
    )


class _MatchMsg:
    """What the KV manager's match handler needs of a NATS message."""

    reply = "inbox"

    def __init__(self, hashes: list[int]) -> None:
        self.data = KVMatchRequest(block_hashes=hashes).encode()
        self.answer: KVMatchReply | None = None

    async def respond(self, data: bytes) -> None:
        self.answer = KVMatchReply.model_validate_json(data)


async def _kv_blocks(engine, now: float) -> None:
    """kv_blocks as the KV manager writes them: events from the instances, then matches."""
    manager = KVManager(KVBlockWriter(engine))
    for kind, iid, tier, hashes in [
        (KVEventKind.STORED, "prefill-0", "dram", [H1, H2, H3]),
        (KVEventKind.STORED, "prefill-1", "dram", [H1, H4]),
        (KVEventKind.STORED, "prefill-1", "disk", [H1]),
        (KVEventKind.STORED, "decode-0", "dram", [H1, H2]),
        (KVEventKind.REMOVED, "prefill-1", "dram", [H4]),
    ]:
        manager.apply(
            KVEvent(kind=kind, instance_id=iid, tier=tier, block_hashes=hashes, block_nbytes=4096),
            now,
        )
    # [H1, H2, H3]: prefill-0 holds all three (twice); [H1, H2]: a tie that decode-0 wins
    # (same length, same DRAM length, smaller id). So H1 and H2 have 3 hits, H3 has 2.
    for hashes in ([H1, H2, H3], [H1, H2, H3], [H1, H2]):
        msg = _MatchMsg(hashes)
        await manager.on_match(msg)  # type: ignore[arg-type]
        assert msg.answer is not None and msg.answer.matches["prefill-0"] == len(hashes)
    await manager.records.flush()  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def seeded_url(tmp_path_factory) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('console') / 'x.db'}"
    upgrade(url)
    asyncio.run(_seed(url))
    return url


@pytest.fixture
def app_env(monkeypatch, seeded_url) -> None:
    monkeypatch.setenv("HALFMOON_DATABASE_URL", seeded_url)
    monkeypatch.setenv("HALFMOON_GATEWAY_URL", UNREACHABLE_GATEWAY)


def _run_app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _metrics(block) -> dict[str, str]:
    return {m.label: m.value for m in block.metric}


def _figure(block, index: int = 0) -> dict:
    return json.loads(block.get("plotly_chart")[index].proto.spec)


def _figures(block) -> dict[str, dict]:
    """Every chart of a block by its title."""
    figs = [json.loads(c.proto.spec) for c in block.get("plotly_chart")]
    return {f["layout"]["title"]["text"]: f for f in figs}


def _traces(fig: dict) -> dict[str, list]:
    """Trace name -> its measured values (gaps left out)."""
    return {d["name"]: [y for y in d["y"] if y is not None] for d in fig["data"]}


def _tab(at: AppTest, label: str):
    return next(t for t in at.tabs if t.label == label)


def test_percentile_matches_linear_interpolation():
    assert queries.percentile([], 50) is None
    assert queries.percentile([None, 7.0], 99) == 7.0
    assert queries.percentile([100.0, 2500.0, 300.0], 50) == 300.0
    assert queries.percentile([100.0, 300.0, 2500.0], 99) == pytest.approx(300 + 2200 * 0.98)
    assert queries.percentile(range(1, 101), 90) == pytest.approx(90.1)


def test_overview_metrics_over_the_hour():
    m = queries.overview([r for r in ROWS if r["id"] != "old"], NOW, 3600.0, slo_ms=2000.0)
    assert m["requests"] == 5 and m["counts"] == {"completed": 3, "failed": 1, "rejected": 1}
    assert m["requests_per_s"] == pytest.approx(5 / 3600)
    assert m["ttft_p50_ms"] == 300.0 and m["e2e_p50_ms"] == 700.0
    assert m["slo_attainment"] == pytest.approx(2 / 5)  # r1, r2 met; r3 slow; r4, r5 missed
    assert m["rejection_rate"] == pytest.approx(1 / 5)
    assert m["hit_rate"] == pytest.approx(HOUR_HIT)
    # TBT per request: r1 500 ms / 10 gaps, r2 400 / 4, r3 400 / 2 -> 50, 100, 200 ms
    assert m["tbt_p50_ms"] == pytest.approx(100.0, rel=1e-6)
    assert queries.overview([], NOW, None, 2000.0)["hit_rate"] is None
    everything = queries.overview(ROWS, NOW, None, slo_ms=2000.0)  # "all": since the first arrival
    assert everything["requests_per_s"] == pytest.approx(6 / 7200)
    assert everything["hit_rate"] == pytest.approx(ALL_HIT)


def test_series_bucket_by_arrival():
    rows = [r for r in ROWS if r["id"] != "old"]
    assert queries.bucket_seconds(300.0, rows, NOW) == 5.0  # 60 buckets over 5 minutes
    series = queries.status_series(rows, 3600.0)
    assert sum(sum(c) for c in series["by_status"].values()) == 5
    assert sum(series["by_status"]["completed"]) == 3
    ttft = queries.ttft_series(rows, 1e10)
    assert ttft["p50"] == [300.0] and ttft["p99"] == [pytest.approx(2456.0)]
    hits = queries.hit_rate_series(ROWS, 1e10)
    assert hits["cluster"] == [pytest.approx(ALL_HIT)]
    assert hits["per_instance"]["prefill-0"] == [pytest.approx(612 / 2100)]
    assert hits["per_instance"]["prefill-1"] == [pytest.approx(1536 / 2048)]


def test_filter_and_timeline():
    assert [r["id"] for r in queries.filter_requests(ROWS, ["failed", "rejected"])] == ["r4", "r5"]
    assert {r["id"] for r in queries.filter_requests(ROWS, None, "decode-1")} == {"r4"}
    assert queries.filter_requests(ROWS, [], None) == []
    phases = queries.request_timeline(ROWS[0])
    assert [p["phase"] for p in phases] == ["queue + prefill (TTFT)", "decode"]
    assert [p["end_ms"] for p in phases] == [pytest.approx(100.0), pytest.approx(600.0)]
    assert queries.request_timeline(ROWS[4])[0]["phase"] == "arrival → rejected"
    r3 = dict(ROWS[2], **{k: ROWS[2]["arrival_time"] + v for k, v in PHASES["r3"].items()})
    assert [
        (p["phase"], round(p["start_ms"]), round(p["end_ms"])) for p in queries.request_timeline(r3)
    ] == [
        ("placement (conductor)", 0, 200),
        ("prefill queue + prefill", 200, 2500),
        ("KV transfer + decode admission", 2500, 2600),
        ("decode", 2600, 2900),
    ]
    # Colocated (no decode-side token): decode starts at the first token; no handoff phase.
    colocated = dict(r3, decode_first_token_time=None)
    assert [p["phase"] for p in queries.request_timeline(colocated)][-1:] == ["decode"]
    assert queries.request_timeline(colocated)[-1]["start_ms"] == pytest.approx(2500.0)
    failed = dict(ROWS[3], dispatch_time=ROWS[3]["arrival_time"] + 0.1)  # no token at all
    assert [p["phase"] for p in queries.request_timeline(failed)] == [
        "placement (conductor)",
        "prefill queue → failed",
    ]


def _info(iid: str, started_at: float, **activity: int) -> InstanceInfo:
    return InstanceInfo(
        instance_id=iid,
        role=Role.DECODE,
        started_at=started_at,
        running=2,
        kv_blocks_total=10,
        kv_blocks_free=4,
        kv_activity=KVActivity(**activity),
    )


def test_load_sampler_one_row_per_interval_with_deltas():
    sampler = LoadSampler()
    first = sampler.sample(_info("d", 0.0, transfers_in=5), 1000.0, 5.0)
    assert first["t"] == 1000.0 and first["interval_s"] is None  # old instance: since when?
    assert first["transfers_in"] is None and (first["running"], first["kv_blocks_used"]) == (2, 6)
    assert sampler.sample(_info("d", 0.0, transfers_in=6), 1004.9, 5.0) is None  # same interval
    row = sampler.sample(_info("d", 0.0, transfers_in=9, bytes_in=100), 1006.0, 5.0)
    assert (row["t"], row["interval_s"], row["transfers_in"], row["bytes_in"]) == (
        1005.0,
        6.0,
        4,
        100,
    )
    # A restart resets the counters: what it reports is all since its start.
    assert sampler.sample(_info("d", 1008.0, transfers_in=2), 1009.0, 5.0) is None
    row = sampler.sample(_info("d", 1008.0, transfers_in=3), 1011.0, 5.0)
    assert (row["t"], row["transfers_in"], row["interval_s"]) == (1010.0, 3, 3.0)
    # A fresh instance's first sample counts from its start, too.
    row = sampler.sample(_info("new", 1010.0, blocks_stored=7), 1012.0, 5.0)
    assert (row["blocks_stored"], row["interval_s"]) == (7, 2.0)


def test_load_series_buckets_gauges_and_counts():
    samples = [
        {
            "instance_id": i,
            "role": role,
            "t": t,
            "interval_s": 5.0,
            **dict.fromkeys(history.GAUGES, 0),
            **dict.fromkeys(
                (
                    "blocks_stored",
                    "blocks_evicted",
                    "disk_stored",
                    "disk_removed",
                    "transfers_out",
                    "bytes_in",
                    "bytes_out",
                ),
                0,
            ),
            "queue_depth": q,
            "transfers_in": n,
        }
        for i, role, t, q, n in [
            ("d0", "decode", 100.0, 1, None),
            ("d0", "decode", 105.0, 3, 2),
            ("d0", "decode", 110.0, 5, 4),
            ("p0", "prefill", 100.0, 7, 0),
        ]
    ]
    series = history.load_series(samples, 10.0)
    assert list(series) == ["p0", "d0"]  # prefill first
    assert series["d0"]["t"] == [100.0, 110.0]
    assert series["d0"]["queue_depth"] == [2.0, 5.0]  # mean of 1 and 3, then 5
    assert series["d0"]["transfers_in"] == [2, 4]  # the unknown first count is left out
    assert history.activity_totals(samples)["transfers_in"] == 6
    assert not history.has_disk(series)
    assert queries.bucket_seconds(300.0, samples, 200.0, "t", history.SAMPLE_S) == 5.0
    assert queries.bucket_seconds(86400.0, samples, 200.0, "t", history.SAMPLE_S) == 1800.0


def test_placement_reasons():
    decision = {
        "policy": "kvcentric",
        "prefill_instance": "p1",
        "decode_instance": "d0",
        "predicted_ttft_ms": 2400.0,
        "predicted_tbt_ms": 20.0,
        "rejected": None,
        "candidates": [
            {"instance": "p0", "ttft_ms": 3300.0},
            {"instance": "p2", "ttft_ms": 1000.0},
            {"instance": "p1", "ttft_ms": 2400.0},
            "junk",
        ],
    }
    rows = history.candidates_table(decision)
    assert [(r["instance"], r["chosen"]) for r in rows] == [
        ("p1", True),
        ("p2", False),
        ("p0", False),
    ]
    assert history.decision_summary(decision, {"ttft_ms": 2500.0}) == (
        "Placed by policy kvcentric on prefill p1, decode d0; predicted TTFT 2,400 ms, "
        "measured 2,500 ms; predicted TBT 20.0 ms"
    )
    assert history.decision_summary({"policy": "x", "rejected": "too slow"}, {}) == (
        "Rejected by policy x: too slow"
    )


def test_report_sections_are_defensive(tmp_path):
    report = {
        "requests": 12,
        "ok": True,
        "name": "x",
        "ttft_ms": {"p50": 3.0, "p99": "n/a"},
        "configs": {"global": {"ttft": 3.07}, "lb": {"ttft": 5.27}},
        "runs": [{"policy": "lru", "hit": 0.37, "nested": {"a": 1, "b": [1]}}],
    }
    metrics, tables = reports.report_sections(report)
    assert metrics == {"requests": 12, "ttft_ms.p50": 3.0}
    assert tables["configs"] == [{"name": "global", "ttft": 3.07}, {"name": "lb", "ttft": 5.27}]
    assert tables["runs"] == [{"policy": "lru", "hit": 0.37, "nested.a": 1}]
    assert reports.report_sections("nonsense") == ({}, {})
    lines = tmp_path / "r.jsonl"
    lines.write_text('{"policy": "lru", "hit_ratio": 0.1}\n{"policy": "lfu", "hit_ratio": 0.2}\n')
    _, tables = reports.report_sections(reports.load_report(str(lines)))
    assert tables["runs"][1] == {"policy": "lfu", "hit_ratio": 0.2}


def test_snapshot_reads_the_window_or_says_why_not(seeded_url, tmp_path):
    hour = queries.load_snapshot(seeded_url, 3600.0)
    assert [r["id"] for r in hour.requests] == ["r5", "r4", "r3", "r2", "r1"]  # newest first
    assert len(queries.load_snapshot(seeded_url, None).requests) == 6
    assert {i["id"]: i["status"] for i in hour.instances}["decode-1"] == "dead"
    with pytest.raises(queries.DatabaseUnavailable, match="no SQLite database"):
        queries.load_snapshot(f"sqlite+aiosqlite:///{tmp_path / 'missing.db'}", None)
    assert not (tmp_path / "missing.db").exists()  # reading never creates a database
    with pytest.raises(queries.DatabaseUnavailable, match=r"\*\*\*"):  # password hidden
        queries.load_snapshot("postgresql+asyncpg://nobody:secret@127.0.0.1:1/none", None)
    old = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    upgrade(old, "0003")  # a database the migrations have not reached: say so, no traceback
    with pytest.raises(queries.DatabaseUnavailable, match="have the migrations run"):
        queries.load_snapshot(old, None)


def test_snapshot_reads_load_history_and_cache_contents(seeded_url):
    snap = queries.load_snapshot(seeded_url, None)
    per = {i: [s for s in snap.samples if s["instance_id"] == i] for i in HEARTBEATS}
    assert {i: len(v) for i, v in per.items()} == {"prefill-0": 11, "decode-0": 11, "prefill-1": 5}
    assert {s["instance_id"] for s in snap.samples} == set(HEARTBEATS)  # 30 h old: pruned
    assert [s["t"] for s in snap.samples] == sorted(s["t"] for s in snap.samples)
    assert per["prefill-0"][0]["blocks_stored"] is None  # the first: since when is unknown
    assert {s["blocks_stored"] for s in per["prefill-0"][1:]} == {10}
    assert {s["kv_blocks_used"] for s in per["decode-0"]} == {150}
    totals = history.activity_totals(snap.samples)
    assert {k: totals[k] for k in TOTALS} == TOTALS
    hot = [(b["block"], b["hits"], b["replicas"], b["instances"]) for b in snap.hot_blocks]
    assert hot == [(f"{H1:016x}", 3, 4, 3), (f"{H2:016x}", 3, 2, 2), (f"{H3:016x}", 2, 1, 1)]
    assert snap.hot_blocks[0]["holders"] == (
        "decode-0/dram, prefill-0/dram, prefill-1/disk, prefill-1/dram"
    )
    assert {(r["instance"], r["tier"]): r["blocks"] for r in snap.kv_tiers} == {
        ("decode-0", "dram"): 2,
        ("prefill-0", "dram"): 3,
        ("prefill-1", "dram"): 1,
        ("prefill-1", "disk"): 1,
    }  # H4 was removed
    decision = queries.load_decision(seeded_url, "r3")
    assert (decision["prefill_instance"], decision["predicted_ttft_ms"]) == ("prefill-1", 2400.0)
    assert [c["instance"] for c in decision["candidates"]] == ["prefill-0", "prefill-1"]
    assert queries.load_decision(seeded_url, "r1") is None


def test_snapshot_reads_replications_or_none_before_their_migration(seeded_url, tmp_path):
    rows = queries.load_snapshot(seeded_url, 3600.0).replications
    assert rows is not None
    assert [(r["prefix_hash"], r["blocks"], r["source"], r["target"]) for r in rows] == [
        (BIG, 8, "prefill-1", "prefill-0"),  # newest first, the hash unsigned again
        (H3, 3, "prefill-0", "prefill-1"),
    ]
    assert len(queries.load_snapshot(seeded_url, None).replications or []) == 3
    table = queries.replication_rows(rows)
    assert [(r["prefix"], r["MiB"], r["copy"], r["heat_rps"], r["holders"]) for r in table] == [
        (f"{BIG:016x}", 32.0, "prefill-1 → prefill-0", 2.25, 2),
        (f"{H3:016x}", 12.0, "prefill-0 → prefill-1", 6.5, 1),
    ]
    assert table[0]["reason"] == "2.25 req/s on 2 holder(s)"
    series = queries.replication_series(rows, 3600.0)
    assert {k: sum(v) for k, v in series["by_target"].items()} == {
        "prefill-0": 32 * MIB,
        "prefill-1": 12 * MIB,
    }
    old = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    upgrade(old, "0007")  # before kv_replications: no table, no error, the rest is read
    snap = queries.load_snapshot(old, None)
    assert snap.replications is None and snap.requests == []
    fresh = f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
    upgrade(fresh)
    assert queries.load_snapshot(fresh, None).replications == []


def test_pool_rows_from_live_and_sql():
    state = {
        "instances": [
            {
                "instance_id": "p0",
                "role": "prefill",
                "status": "ready",
                "heartbeat_age_s": 0.4,
                "queue_depth": 3,
                "running": 1,
                "kv_tokens_used": 64,
                "kv_blocks_gpu": 7,
                "pid": 1,
            },
            {"instance_id": "d0", "role": "decode", "status": "ready", "heartbeat_age_s": 9.0},
            {"instance_id": "g", "role": "gateway"},
            "junk",
        ]
    }
    rows = live.pool_from_live(state)
    assert [(r["instance"], r["health"]) for r in rows] == [("p0", "alive"), ("d0", "DEAD")]
    assert rows[0]["kv_blocks_gpu"] == 7 and "pid" not in rows[0]
    sql = [
        {"id": "d1", "role": "decode", "status": "dead", "last_heartbeat": NOW, "info": {}},
        {
            "id": "p1",
            "role": "prefill",
            "status": "ready",
            "last_heartbeat": NOW - 1,
            "info": {"queue_depth": 2},
        },
    ]
    rows = live.pool_from_sql(sql, NOW)
    assert [(r["instance"], r["health"], r["queue_depth"]) for r in rows] == [
        ("p1", "alive", 2),
        ("d1", "DEAD", 0),
    ]
    with pytest.raises(live.ClusterUnavailable):
        live.fetch_state(UNREACHABLE_GATEWAY, timeout_s=1.0)


def test_charts_carry_the_data():
    series = queries.status_series([r for r in ROWS if r["id"] != "old"], 3600.0)
    fig = charts.requests_by_status(series, 3600.0)
    assert {t.name: sum(t.y) for t in fig.data} == {"completed": 3, "failed": 1, "rejected": 1}
    pool = live.pool_from_sql(
        [
            {
                "id": "d1",
                "role": "decode",
                "status": "dead",
                "last_heartbeat": NOW,
                "info": {"running": 2},
            }
        ],
        NOW,
    )
    fig = charts.pool_load(pool)
    assert list(fig.data[1].x) == ["d1 (DEAD)"] and list(fig.data[1].y) == [2]
    fig = charts.hit_rate_over_time(queries.hit_rate_series(ROWS, 1e10))
    assert fig.data[0].name == "cluster" and fig.data[0].y[0] == pytest.approx(100 * ALL_HIT)
    fig = charts.request_timeline(queries.request_timeline(ROWS[0]), "r1")
    assert [(b.base[0], b.x[0]) for b in fig.data] == [
        (0.0, pytest.approx(100.0)),
        (pytest.approx(100.0), pytest.approx(500.0)),
    ]


def test_app_overview_from_sql(app_env):
    at = _run_app()
    assert [t.label for t in at.tabs] == [
        "Overview",
        "Pools",
        "Planner",
        "KV cache",
        "Requests",
        "Benchmarks",
    ]
    assert not at.error
    assert any(
        w.value.startswith(f"Cluster unreachable at {UNREACHABLE_GATEWAY}/admin/state")
        for w in at.warning
    )
    m = _metrics(_tab(at, "Overview"))
    assert (m["Requests"], m["Failed"], m["TTFT p50"]) == ("5", "1", "300 ms")
    assert m["E2E p50"] == "700 ms"
    assert (m["SLO attainment"], m["Rejection rate"]) == ("40.0%", "20.0%")
    assert m["KV hit rate"] == f"{100 * HOUR_HIT:.1f}%"
    status = _figure(_tab(at, "Overview"), 0)
    assert {d["name"]: sum(d["y"]) for d in status["data"]} == {
        "completed": 3,
        "failed": 1,
        "rejected": 1,
    }
    ttft = _figure(_tab(at, "Overview"), 1)
    assert [d["name"] for d in ttft["data"]] == ["TTFT p50", "TTFT p99"]
    # 60 s buckets: r1..r3 (at -100, -90, -80 s) share one, or r3 shares with r2, or is alone.
    assert max(y for y in ttft["data"][1]["y"] if y is not None) in (2456.0, 2478.0, 2500.0)
    assert [s["y0"] for s in ttft["layout"]["shapes"]] == [2000.0]  # the SLO line
    # A wider window and a looser SLO change the numbers.
    at.sidebar.selectbox(key="window").select("all")
    at.sidebar.number_input(key="slo_ms").set_value(3000)
    at.run()
    m = _metrics(_tab(at, "Overview"))
    assert m["Requests"] == "6" and m["KV hit rate"] == f"{100 * ALL_HIT:.1f}%"
    assert m["SLO attainment"] == f"{100 * 4 / 6:.1f}%"


def test_app_pools_mark_the_dead_instance(app_env):
    pools = _tab(_run_app(), "Pools")
    assert "From SQL (instances table)" in [c.value for c in pools.caption]
    assert any("Dead instances: decode-1" in w.value for w in pools.warning)
    prefill, decode = (d.value for d in pools.dataframe)
    assert list(prefill["instance"]) == ["prefill-0", "prefill-1"]  # the conductor row is left out
    health = dict(zip(decode["instance"], decode["health"]))
    assert health == {"decode-0": "alive", "decode-1": "DEAD"}
    queue, running = _figure(pools)["data"]
    assert queue["x"] == ["prefill-0", "prefill-1", "decode-0", "decode-1 (DEAD)"]
    assert queue["y"] == [2, 0, 0, 1] and running["y"] == [1, 3, 4, 0]


def test_app_pools_load_history(app_env):
    at = _run_app()
    figs = _figures(_tab(at, "Pools"))
    assert set(figs) == {
        "Load per instance",
        "Queue depth over time",
        "Running batch over time",
        "KV blocks over time, DRAM tier",
        "KV blocks over time, disk tier",
    }
    queue = _traces(figs["Queue depth over time"])
    assert list(queue) == ["prefill-0", "prefill-1", "decode-0"]  # prefill first, by name
    assert {i: set(v) for i, v in queue.items()} == {
        "prefill-0": {2},
        "prefill-1": {0},
        "decode-0": {0},
    }  # bucket means of constants
    running = _traces(figs["Running batch over time"])
    assert {i: set(v) for i, v in running.items()} == {
        "prefill-0": {1},
        "prefill-1": {3},
        "decode-0": {4},
    }
    dram = _traces(figs["KV blocks over time, DRAM tier"])
    assert (set(dram["decode-0 used"]), set(dram["decode-0 free"])) == ({150}, {50})
    assert (set(dram["prefill-0 used"]), set(dram["prefill-1 used"])) == ({40}, {10})
    disk = _traces(figs["KV blocks over time, disk tier"])
    assert (set(disk["prefill-1 used"]), set(disk["prefill-1 free"])) == ({3}, {97})
    # Five minutes: 5 s buckets, so every sample is a point of its own.
    at.sidebar.selectbox(key="window").select("last 5 min").run()
    queue = _traces(_figures(_tab(at, "Pools"))["Queue depth over time"])
    assert {i: len(v) for i, v in queue.items()} == {
        "prefill-0": 11,
        "prefill-1": 5,
        "decode-0": 11,
    }


def test_app_kv_cache_page(app_env):
    kv = _tab(_run_app(), "KV cache")
    m = _metrics(kv)
    assert {k: v for k, v in m.items() if "hit rate" in k} == {
        "Cluster hit rate": f"{100 * HOUR_HIT:.1f}%",
        "prefill-0 hit rate": f"{100 * 512 / 2000:.1f}%",
        "prefill-1 hit rate": f"{100 * 1536 / 2048:.1f}%",
    }
    lines = {d["name"]: [y for y in d["y"] if y is not None] for d in _figure(kv)["data"]}
    assert set(lines) == {"cluster", "prefill-0", "prefill-1"}  # token-weighted, in percent
    assert sum(lines["prefill-1"]) / len(lines["prefill-1"]) == pytest.approx(75.0)
    # Hottest prefixes, with where their copies are.
    hot = kv.dataframe[0].value
    assert list(hot["block"]) == [f"{H1:016x}", f"{H2:016x}", f"{H3:016x}"]
    assert (list(hot["hits"]), list(hot["replicas"]), list(hot["instances"])) == (
        [3, 3, 2],
        [4, 2, 1],
        [3, 2, 1],
    )
    figs = _figures(kv)
    tiers = figs["Cached KV blocks per instance and tier"]["data"]
    assert {d["name"]: dict(zip(d["x"], d["y"])) for d in tiers} == {
        "disk": {"decode-0": 0, "prefill-0": 0, "prefill-1": 1},
        "dram": {"decode-0": 2, "prefill-0": 3, "prefill-1": 1},
    }
    # Evictions and transfers over the window, as the heartbeats counted them.
    assert (
        m["Blocks stored"],
        m["Blocks evicted"],
        m["Transfers in"],
        m["Transfers out"],
        m["MiB transferred"],
    ) == ("110", "20", "10", "10", "10.0")
    churn = _traces(figs["KV blocks stored and evicted per 60 s"])
    assert (sum(churn["prefill-0 stored"]), sum(churn["prefill-0 evicted"])) == (100, 20)
    assert (sum(churn["prefill-1 stored"]), sum(churn["prefill-1 to disk"])) == (10, 5)
    transfers = _traces(figs["KV transfers per 60 s"])
    assert (sum(transfers["decode-0 in"]), sum(transfers["prefill-0 out"])) == (10, 10)
    assert sum(transfers["prefill-0 in"]) == 0
    mib = _traces(figs["KV MiB transferred per 60 s"])
    assert sum(mib["decode-0 in"]) == pytest.approx(10.0)


def test_app_kv_replication(app_env):
    kv = _tab(_run_app(), "KV cache")
    m = _metrics(kv)
    assert (m["Replications"], m["Blocks replicated"], m["MiB replicated"]) == ("2", "11", "44.0")
    fig = _figures(kv)["Hot prefixes replicated: MiB per 60 s by target"]
    assert {k: sum(v) for k, v in _traces(fig).items()} == {"prefill-0": 32.0, "prefill-1": 12.0}
    table = kv.dataframe[1].value  # after the hottest prefixes
    assert list(table["prefix"]) == [f"{BIG:016x}", f"{H3:016x}"]
    assert list(table["copy"]) == ["prefill-1 → prefill-0", "prefill-0 → prefill-1"]
    assert (list(table["blocks"]), list(table["MiB"]), list(table["holders"])) == (
        [8, 3],
        [32.0, 12.0],
        [2, 1],
    )


def test_app_kv_replication_before_its_migration(monkeypatch, tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0007")
    monkeypatch.setenv("HALFMOON_DATABASE_URL", url)
    monkeypatch.setenv("HALFMOON_GATEWAY_URL", UNREACHABLE_GATEWAY)
    at = _run_app()
    assert not at.error  # no page failed
    kv = _tab(at, "KV cache")
    assert any("kv_replications" in i.value for i in kv.info)
    assert not kv.dataframe and "Replications" not in _metrics(kv)


def test_app_requests_filter_and_timeline(app_env):
    at = _run_app()
    table = _tab(at, "Requests").dataframe[0].value
    assert list(table["id"]) == ["r5", "r4", "r3", "r2", "r1"]
    at.multiselect(key="req_status").set_value(["failed", "completed"])
    at.selectbox(key="req_instance").select("prefill-1")
    at.run()
    assert list(_tab(at, "Requests").dataframe[0].value["id"]) == ["r4", "r3"]
    at.selectbox(key="req_id").select("r4").run()
    assert any(
        i.value == "The conductor recorded no decision for this request."
        for i in _tab(at, "Requests").info
    )
    at.selectbox(key="req_id").select("r3").run()
    req = _tab(at, "Requests")
    bars = _figures(req)["Timeline of r3"]["data"]
    assert [(b["name"], round(b["base"][0]), round(b["x"][0])) for b in bars] == [
        ("placement (conductor)", 0, 200),
        ("prefill queue + prefill", 200, 2300),
        ("KV transfer + decode admission", 2500, 100),
        ("decode", 2600, 300),
    ]
    assert [m.value for m in req.markdown if m.value.startswith("**Placement.**")] == [
        "**Placement.** Placed by policy kvcentric on prefill prefill-1, decode decode-0; "
        "predicted TTFT 2,400 ms, measured 2,500 ms; predicted TBT 20.0 ms"
    ]
    candidates = req.dataframe[1].value
    assert list(candidates["instance"]) == ["prefill-1", "prefill-0"]
    assert list(candidates["chosen"]) == [True, False]
    assert list(candidates["prefix_blocks"]) == [96, 0]
    costs = _figures(req)["Predicted TTFT per candidate for r3"]["data"]
    assert {d["name"]: d["x"] for d in costs} == {
        "prefix transfer": [0.0, 0.0],
        "queue": [400.0, 1500.0],
        "prefill": [2000.0, 1800.0],
    }


def test_app_requests_rejection_reason(app_env):
    at = _run_app()
    at.selectbox(key="req_id").select("r5").run()
    req = _tab(at, "Requests")
    assert [m.value for m in req.markdown if m.value.startswith("**Placement.**")] == [
        "**Placement.** Rejected by policy kvcentric: TTFT SLO cannot be met"
    ]
    assert [b["name"] for b in _figures(req)["Timeline of r5"]["data"]] == ["arrival → rejected"]


def test_app_benchmarks_page(app_env, tmp_path):
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps(
            {
                "requests": 120,
                "ttft_ms": {"mean": 3070.0},
                "configs": [
                    {"policy": "global", "ttft_s": 3.07},
                    {"policy": "load-balance", "ttft_s": 5.27},
                ],
            }
        )
    )
    at = _run_app()
    assert any("Enter the path" in i.value for i in _tab(at, "Benchmarks").info)
    at.text_input(key="report_path").input(str(report)).run()
    bench = _tab(at, "Benchmarks")
    assert _metrics(bench) == {"requests": "120", "ttft_ms.mean": "3,070"}
    assert list(bench.dataframe[0].value["policy"]) == ["global", "load-balance"]
    bars = _figure(bench)["data"][0]
    assert bars["x"] == ["global", "load-balance"] and bars["y"] == [3.07, 5.27]
    at.text_input(key="report_path").input(str(tmp_path / "nope.json")).run()
    assert not at.exception
    assert any(e.value.startswith("Cannot read report") for e in _tab(at, "Benchmarks").error)


def test_app_database_unreachable(monkeypatch):
    monkeypatch.setenv("HALFMOON_DATABASE_URL", "postgresql+asyncpg://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("HALFMOON_GATEWAY_URL", UNREACHABLE_GATEWAY)
    at = _run_app()
    assert len(at.error) == 1 and at.error[0].value.startswith("Database unreachable: ")
    assert "127.0.0.1:1" in at.error[0].value
    assert any("neither the gateway nor the database" in i.value for i in _tab(at, "Pools").info)
    assert any(i.value == "No load history without the database." for i in _tab(at, "Pools").info)
    assert any("No KV statistics" in i.value for i in _tab(at, "KV cache").info)
    assert not _tab(at, "Overview").metric
    assert [i.value for i in _tab(at, "Planner").info] == [
        "No planner record without the database."
    ]
    assert not at.get("plotly_chart")


class _Admin(BaseHTTPRequestHandler):
    state: dict = {}

    def do_GET(self) -> None:
        found = self.path == "/admin/state"
        self.send_response(200 if found else 404)
        self.end_headers()
        self.wfile.write(json.dumps(self.state if found else {}).encode())

    def log_message(self, *args) -> None:  # keep test output quiet
        pass


@pytest.fixture
def fake_gateway():
    live_info = {"status": "ready", "queue_depth": 1, "running": 2, "kv_tokens_used": 64}
    _Admin.state = {
        "gateway": "gw-1",
        "uptime_s": 5.0,
        "in_flight": 2,
        "instances": [
            {
                **live_info,
                "instance_id": "prefill-9",
                "role": "prefill",
                "heartbeat_age_s": 0.2,
                "kv_blocks_gpu": 12,
            },
            {
                **live_info,
                "instance_id": "decode-9",
                "role": "decode",
                "heartbeat_age_s": 7.5,
                "queue_depth": 3,
            },
        ],
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Admin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_app_pools_from_the_live_gateway(app_env, monkeypatch, fake_gateway):
    monkeypatch.setenv("HALFMOON_GATEWAY_URL", fake_gateway)
    at = _run_app()
    assert not any("Cluster unreachable" in w.value for w in at.warning)
    pools = _tab(at, "Pools")
    assert pools.caption[0].value == "Live from gateway gw-1: 2 requests in flight"
    prefill, decode = (d.value for d in pools.dataframe)
    assert prefill.iloc[0]["kv_blocks_gpu"] == 12  # fields newer gateways add still show
    assert decode.iloc[0]["health"] == "DEAD"  # 7.5 s since its last heartbeat
    queue = _figure(pools)["data"][0]
    assert queue["x"] == ["prefill-9", "decode-9 (DEAD)"] and queue["y"] == [1, 3]


def test_serve_command_and_env(monkeypatch):
    monkeypatch.setenv("HALFMOON_CONSOLE_PORT", "8600")
    args, extra = serve.build_parser().parse_known_args(
        ["--host", "0.0.0.0", "--gateway-url", "http://gw:8000", "--theme.base", "dark"]
    )
    cmd = serve.command(args.host, args.port, extra)
    assert cmd[:4] == [sys.executable, "-m", "streamlit", "run"] and cmd[4].endswith("app.py")
    assert dict(zip(cmd[5::2], cmd[6::2])) == {
        "--server.headless": "true",
        "--server.port": "8600",
        "--server.address": "0.0.0.0",
        "--browser.gatherUsageStats": "false",
        "--theme.base": "dark",
    }
    assert serve.child_env(args)["HALFMOON_GATEWAY_URL"] == "http://gw:8000"


def test_serve_runs_streamlit_and_forwards_sigterm(seeded_url, tmp_path):
    port = free_port()
    health = f"http://127.0.0.1:{port}/_stcore/health"
    env = dict(os.environ, PYTHONPATH=str(REPO), HALFMOON_DATABASE_URL=seeded_url)
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # its own session, so cleanup can reach the streamlit child
        proc = subprocess.Popen(
            [sys.executable, "-m", "console.serve", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(health, timeout=2) as reply:
                    assert reply.read() == b"ok"
                    break
            except OSError:
                assert proc.poll() is None, log.read_text()
                assert time.time() < deadline, "streamlit did not come up"
                time.sleep(0.3)
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        with pytest.raises(OSError):  # the streamlit child went with it
            urllib.request.urlopen(health, timeout=2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group: serve and a streamlit left behind
        proc.wait()
