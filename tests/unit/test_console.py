"""Console: pure queries and charts, then the app through Streamlit's AppTest over a SQLite
database seeded by the real write path (Alembic + RecordWriter), then `serve` for real."""

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

from console import charts, live, queries, serve
from shared.db.records import RecordWriter
from shared.db.session import make_engine, upgrade
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
HOUR_HIT = (512 + 1536) / (1000 + 1000 + 2048)  # completed requests of the last hour
ALL_HIT = (512 + 1536 + 100) / (1000 + 1000 + 2048 + 100)


def _row(rid, status, offset, prefill, decode, prompt, cached, completion, ttft, e2e):
    arrival = NOW + offset
    return {"id": rid, "status": status, "arrival_time": arrival, "prompt_tokens": prompt,
            "cached_tokens": cached, "completion_tokens": completion, "ttft_ms": ttft,
            "e2e_ms": e2e, "prefill_instance": prefill, "decode_instance": decode,
            "first_token_time": None if ttft is None else arrival + ttft / 1000,
            "finish_time": arrival + (e2e or 5) / 1000}


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
        writer.request_accepted(id=r["id"], model="m", status="queued",
                                arrival_time=r["arrival_time"], prompt_tokens=r["prompt_tokens"])
        if r["prefill_instance"]:
            writer.request_update(r["id"], status="running", prefill_instance=r["prefill_instance"],
                                  decode_instance=r["decode_instance"])
    await writer.flush()  # accepted before finished, as the gateway writes them
    for r in rows:
        done = {k: r[k] for k in ("first_token_time", "finish_time", "completion_tokens",
                                  "cached_tokens", "ttft_ms", "e2e_ms")}
        reason = "stop" if r["status"] == "completed" else None
        writer.request_finished(r["id"], r["status"], error=ERRORS.get(r["status"]),
                                finish_reason=reason, **done)
    for iid, queue, running in [("prefill-0", 2, 1), ("prefill-1", 0, 3), ("decode-0", 0, 4),
                                ("decode-1", 1, 0), ("conductor-0", 0, 0)]:
        writer.instance_seen(id=iid, role=iid.split("-")[0], host="127.0.0.1", status="ready",
                             started_at=now - 600, last_heartbeat=now,
                             info={"queue_depth": queue, "running": running,
                                   "kv_tokens_used": 1000 * running})
    await writer.flush()
    writer.instance_seen(id="decode-1", status="dead")  # as the conductor's sweep writes it
    await writer.close()
    await engine.dispose()


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


def test_report_sections_are_defensive(tmp_path):
    report = {"requests": 12, "ok": True, "name": "x", "ttft_ms": {"p50": 3.0, "p99": "n/a"},
              "configs": {"global": {"ttft": 3.07}, "lb": {"ttft": 5.27}},
              "runs": [{"policy": "lru", "hit": 0.37, "nested": {"a": 1, "b": [1]}}]}
    metrics, tables = queries.report_sections(report)
    assert metrics == {"requests": 12, "ttft_ms.p50": 3.0}
    assert tables["configs"] == [{"name": "global", "ttft": 3.07}, {"name": "lb", "ttft": 5.27}]
    assert tables["runs"] == [{"policy": "lru", "hit": 0.37, "nested.a": 1}]
    assert queries.report_sections("nonsense") == ({}, {})
    lines = tmp_path / "r.jsonl"
    lines.write_text('{"policy": "lru", "hit_ratio": 0.1}\n{"policy": "lfu", "hit_ratio": 0.2}\n')
    _, tables = queries.report_sections(queries.load_report(str(lines)))
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


def test_pool_rows_from_live_and_sql():
    state = {"instances": [
        {"instance_id": "p0", "role": "prefill", "status": "ready", "heartbeat_age_s": 0.4,
         "queue_depth": 3, "running": 1, "kv_tokens_used": 64, "kv_blocks_gpu": 7, "pid": 1},
        {"instance_id": "d0", "role": "decode", "status": "ready", "heartbeat_age_s": 9.0},
        {"instance_id": "g", "role": "gateway"}, "junk"]}
    rows = live.pool_from_live(state)
    assert [(r["instance"], r["health"]) for r in rows] == [("p0", "alive"), ("d0", "DEAD")]
    assert rows[0]["kv_blocks_gpu"] == 7 and "pid" not in rows[0]
    sql = [{"id": "d1", "role": "decode", "status": "dead", "last_heartbeat": NOW, "info": {}},
           {"id": "p1", "role": "prefill", "status": "ready", "last_heartbeat": NOW - 1,
            "info": {"queue_depth": 2}}]
    rows = live.pool_from_sql(sql, NOW)
    assert [(r["instance"], r["health"], r["queue_depth"]) for r in rows] == [
        ("p1", "alive", 2), ("d1", "DEAD", 0)]
    with pytest.raises(live.ClusterUnavailable):
        live.fetch_state(UNREACHABLE_GATEWAY, timeout_s=1.0)


def test_charts_carry_the_data():
    series = queries.status_series([r for r in ROWS if r["id"] != "old"], 3600.0)
    fig = charts.requests_by_status(series, 3600.0)
    assert {t.name: sum(t.y) for t in fig.data} == {"completed": 3, "failed": 1, "rejected": 1}
    pool = live.pool_from_sql([{"id": "d1", "role": "decode", "status": "dead",
                                "last_heartbeat": NOW, "info": {"running": 2}}], NOW)
    fig = charts.pool_load(pool)
    assert list(fig.data[1].x) == ["d1 (DEAD)"] and list(fig.data[1].y) == [2]
    fig = charts.hit_rate_over_time(queries.hit_rate_series(ROWS, 1e10))
    assert fig.data[0].name == "cluster" and fig.data[0].y[0] == pytest.approx(100 * ALL_HIT)
    fig = charts.request_timeline(queries.request_timeline(ROWS[0]), "r1")
    assert [(b.base[0], b.x[0]) for b in fig.data] == [(0.0, pytest.approx(100.0)),
                                                     (pytest.approx(100.0), pytest.approx(500.0))]


def test_app_overview_from_sql(app_env):
    at = _run_app()
    assert [t.label for t in at.tabs] == ["Overview", "Pools", "KV cache", "Requests", "Benchmarks"]
    assert not at.error
    assert any(w.value.startswith(f"Cluster unreachable at {UNREACHABLE_GATEWAY}/admin/state")
               for w in at.warning)
    m = _metrics(_tab(at, "Overview"))
    assert (m["Requests"], m["Failed"], m["TTFT p50"]) == ("5", "1", "300 ms")
    assert m["E2E p50"] == "700 ms"
    assert (m["SLO attainment"], m["Rejection rate"]) == ("40.0%", "20.0%")
    assert m["KV hit rate"] == f"{100 * HOUR_HIT:.1f}%"
    status = _figure(_tab(at, "Overview"), 0)
    assert {d["name"]: sum(d["y"]) for d in status["data"]} == {
        "completed": 3, "failed": 1, "rejected": 1}
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


def test_app_kv_cache_page(app_env):
    kv = _tab(_run_app(), "KV cache")
    assert _metrics(kv) == {"Cluster hit rate": f"{100 * HOUR_HIT:.1f}%",
                            "prefill-0 hit rate": f"{100 * 512 / 2000:.1f}%",
                            "prefill-1 hit rate": f"{100 * 1536 / 2048:.1f}%"}
    lines = {d["name"]: [y for y in d["y"] if y is not None] for d in _figure(kv)["data"]}
    assert set(lines) == {"cluster", "prefill-0", "prefill-1"}  # token-weighted, in percent
    assert sum(lines["prefill-1"]) / len(lines["prefill-1"]) == pytest.approx(75.0)


def test_app_requests_filter_and_timeline(app_env):
    at = _run_app()
    table = _tab(at, "Requests").dataframe[0].value
    assert list(table["id"]) == ["r5", "r4", "r3", "r2", "r1"]
    at.multiselect(key="req_status").set_value(["failed", "completed"])
    at.selectbox(key="req_instance").select("prefill-1")
    at.run()
    assert list(_tab(at, "Requests").dataframe[0].value["id"]) == ["r4", "r3"]
    at.selectbox(key="req_id").select("r3").run()
    bars = _figure(_tab(at, "Requests"))["data"]
    assert [(b["name"], b["base"][0], round(b["x"][0])) for b in bars] == [
        ("queue + prefill (TTFT)", 0.0, 2500), ("decode", pytest.approx(2500.0), 400)]


def test_app_benchmarks_page(app_env, tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"requests": 120, "ttft_ms": {"mean": 3070.0},
                                  "configs": [{"policy": "global", "ttft_s": 3.07},
                                              {"policy": "load-balance", "ttft_s": 5.27}]}))
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
    assert not _tab(at, "Overview").metric


class _Admin(BaseHTTPRequestHandler):
    state: dict = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        found = self.path == "/admin/state"
        self.send_response(200 if found else 404)
        self.end_headers()
        self.wfile.write(json.dumps(self.state if found else {}).encode())

    def log_message(self, *args) -> None:  # keep test output quiet
        pass


@pytest.fixture
def fake_gateway():
    live_info = {"status": "ready", "queue_depth": 1, "running": 2, "kv_tokens_used": 64}
    _Admin.state = {"gateway": "gw-1", "uptime_s": 5.0, "in_flight": 2, "instances": [
        {**live_info, "instance_id": "prefill-9", "role": "prefill", "heartbeat_age_s": 0.2,
         "kv_blocks_gpu": 12}, {**live_info, "instance_id": "decode-9", "role": "decode",
                                "heartbeat_age_s": 7.5, "queue_depth": 3}]}
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
        ["--host", "0.0.0.0", "--gateway-url", "http://gw:8000", "--theme.base", "dark"])
    cmd = serve.command(args.host, args.port, extra)
    assert cmd[:4] == [sys.executable, "-m", "streamlit", "run"] and cmd[4].endswith("app.py")
    assert dict(zip(cmd[5::2], cmd[6::2])) == {
        "--server.headless": "true", "--server.port": "8600", "--server.address": "0.0.0.0",
        "--browser.gatherUsageStats": "false", "--theme.base": "dark"}
    assert serve.child_env(args)["HALFMOON_GATEWAY_URL"] == "http://gw:8000"


def test_serve_runs_streamlit_and_forwards_sigterm(seeded_url, tmp_path):
    port = free_port()
    health = f"http://127.0.0.1:{port}/_stcore/health"
    env = dict(os.environ, PYTHONPATH=str(REPO), HALFMOON_DATABASE_URL=seeded_url)
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # its own session, so cleanup can reach the streamlit child
        proc = subprocess.Popen([sys.executable, "-m", "console.serve", "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
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
