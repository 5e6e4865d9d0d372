"""Console, Planner tab: the planner's record read back from SQLite (written by the
RecordWriter, as the conductor writes it), its series, tables and chart, then the page
through Streamlit's AppTest: with decisions, without (the load samples' role counts), and
on a database from before migration 0006."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from streamlit.testing.v1 import AppTest

from console import charts, planner, queries
from shared.db.records import RecordWriter
from shared.db.session import make_engine, upgrade
from shared.messages import InstanceInfo, Role
from tests.integration.test_planner_records import plan, switch
from tests.unit.test_console import APP, UNREACHABLE_GATEWAY, _figures, _tab

NOW = time.time()
# (offset s, current split, best split, switch instance or None, acted, mode)
DECISIONS = [
    (-7200, (2, 1), (2, 1), None, False, "advisory"),  # outside the hour
    (-600, (2, 1), (2, 1), None, False, "advisory"),
    (-300, (2, 1), (1, 2), "prefill-1", False, "advisory"),  # would switch
    (-200, (2, 1), (1, 2), "prefill-1", True, "active"),  # switched
    (-100, (1, 2), (1, 2), None, False, "active"),
    (-50, (1, 2), (1, 2), None, False, "active"),
]
SWITCHES = [  # (id, offset s, status, from, detail)
    ("s-done", -200, "done", "prefill", "3 sequences finished"),
    ("s-refused", -150, "refused", "", "would leave the decode pool empty"),
]


def _decision(offset, current, best, inst, acted, mode) -> dict:
    changes = {"switch_instance": None, "switch_from": None, "switch_to": None, "drain_s": None}
    return plan(
        NOW + offset,
        mode=mode,
        acted=acted,
        current_prefill=current[0],
        current_decode=current[1],
        best_prefill=best[0],
        best_decode=best[1],
        **({} if inst else changes),
    )


async def _seed(url: str, decisions: bool) -> None:
    engine = make_engine(url)
    writer = RecordWriter(engine, flush_interval_s=0.0)
    await writer.start()
    if decisions:
        for d in DECISIONS:
            writer.plan_decision(**_decision(*d))
        for sid, offset, status, from_role, detail in SWITCHES:
            writer.role_switch(
                **switch(sid, NOW + offset, status, from_role=from_role, detail=detail)
            )
        writer.role_switch(id="s-done", finished_at=NOW - 197.5, drain_s=2.5)
    for offset in range(-60, 0, 5):  # two prefill instances, one decode
        for iid, role in (("prefill-0", Role.PREFILL), ("prefill-1", Role.PREFILL),
                          ("decode-0", Role.DECODE)):  # fmt: skip
            info = InstanceInfo(instance_id=iid, role=role, started_at=NOW - 600)
            writer.load_sample(info, time.time() + offset, 5.0, 3600.0)
    await writer.close()
    await engine.dispose()


def _database(tmp_path_factory, name: str, decisions: bool, revision: str = "head") -> str:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp(name) / 'x.db'}"
    upgrade(url, revision)
    if revision == "head":
        asyncio.run(_seed(url, decisions))
    return url


@pytest.fixture(scope="module")
def planned_url(tmp_path_factory) -> str:
    return _database(tmp_path_factory, "planned", decisions=True)


def test_load_planner_reads_the_window(planned_url):
    data = queries.load_planner(planned_url, 3600.0, now=NOW)
    assert [r["created"] - NOW for r in data.splits] == [pytest.approx(o) for o in
                                                         (-600, -300, -200, -100, -50)]  # fmt: skip
    assert [r["created"] - NOW for r in data.notable] == [pytest.approx(-200), pytest.approx(-300)]
    assert data.notable[0]["estimates"][1]["goodput_rps"] == 3.2  # full rows
    assert data.latest is not None and data.latest["created"] == pytest.approx(NOW - 50)
    assert [s["id"] for s in data.switches] == ["s-refused", "s-done"]
    done = data.switches[1]
    assert (done["status"], done["drain_s"], done["detail"]) == ("done", 2.5, SWITCHES[0][4])
    assert len(queries.load_planner(planned_url, None, now=NOW).splits) == len(DECISIONS)
    empty = queries.load_planner(planned_url, 10.0, now=NOW)
    assert (empty.splits, empty.notable, empty.switches) == ([], [], [])
    assert empty.latest is not None  # the newest decision, however old


def test_series_and_tables(planned_url):
    data = queries.load_planner(planned_url, 3600.0, now=NOW)
    steps = planner.split_steps(data.splits)
    # first, the two changes of best and current split, and the last
    assert [t - NOW for t in steps["t"]] == [pytest.approx(o) for o in (-600, -300, -100, -50)]
    assert steps["current_prefill"] == [2, 2, 1, 1] and steps["best_decode"] == [1, 2, 2, 2]
    assert planner.split_steps([]) == {"t": [], **{k: [] for k in list(steps)[1:]}}
    marks = planner.switch_marks(data)
    assert [(m["t"] - NOW, m["kind"]) for m in marks] == [
        (pytest.approx(-300), "advised"),
        (pytest.approx(-200), "done"),
        (pytest.approx(-150), "refused"),
    ]
    assert marks[2]["text"] == "prefill-1: ? → decode (planner, refused)"
    rows = planner.decision_rows(data.notable)
    assert rows[0] | {"created": 0} == {
        "created": 0,
        "mode": "active",
        "split": "2P:1D",
        "best": "1P:2D",
        "switch": "prefill-1: prefill → decode",
        "acted": True,
        "goodput_now_rps": 1.5,
        "goodput_best_rps": 3.2,
        "drain_s": 0.8,
        "attainment": 0.75,
        "reason": plan(0)["reason"],
    }
    assert planner.goodput({"estimates": [{"prefill": 1, "decode": 1}]}, 3, 3) is None
    assert [r["switch"] for r in planner.switch_rows(data.switches)] == [
        "? → decode",
        "prefill → decode",
    ]


def test_roles_from_samples_and_charts():
    samples = [
        {"t": 100.0, "instance_id": "p0", "role": "prefill"},
        {"t": 104.0, "instance_id": "p0", "role": "prefill"},  # same bucket: counted once
        {"t": 101.0, "instance_id": "d0", "role": "decode"},
        {"t": 111.0, "instance_id": "p0", "role": "decode"},  # switched
        {"t": 112.0, "instance_id": "d0", "role": "decode"},
    ]
    series = planner.roles_from_samples(samples, 10.0)
    assert series == {"t": [100.0, 110.0], "prefill": [1, 0], "decode": [1, 2]}
    fig = json.loads(charts.roles_over_time(series, 10.0).to_json())
    assert [(d["name"], d["y"]) for d in fig["data"]] == [("prefill", [1, 0]), ("decode", [1, 2])]
    steps = {"t": [100.0, 200.0], "current_prefill": [2, 1], "current_decode": [1, 2],
             "best_prefill": [1, 1], "best_decode": [2, 2]}  # fmt: skip
    marks = [{"t": 150.0, "kind": "done", "text": "p1: prefill → decode"}]
    fig = json.loads(charts.split_over_time(steps, marks).to_json())
    by_name = {d["name"]: d for d in fig["data"]}
    assert list(by_name) == ["prefill", "best prefill", "decode", "best decode", "switch done"]
    assert by_name["prefill"]["y"] == [2, 1] and by_name["prefill"]["line"]["shape"] == "hv"
    assert by_name["switch done"]["y"] == [2.5] and by_name["switch done"]["hovertext"] == [
        "p1: prefill → decode"
    ]


def _run_app(monkeypatch, url: str) -> AppTest:
    monkeypatch.setenv("HALFMOON_DATABASE_URL", url)
    monkeypatch.setenv("HALFMOON_GATEWAY_URL", UNREACHABLE_GATEWAY)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_app_planner_page(monkeypatch, planned_url):
    page = _tab(_run_app(monkeypatch, planned_url), "Planner")
    metrics = {m.label: m.value for m in page.metric}
    assert metrics["Planner mode"] == "active" and metrics["Split now"] == "1P:2D"
    assert metrics["SLO attainment"] == "75.0%"
    split = _figures(page)["Prefill/decode split over time"]
    names = [d["name"] for d in split["data"]]
    assert {"prefill", "decode", "switch done", "switch refused", "switch advised"} <= set(names)
    decisions, switches = (d.value for d in page.dataframe)
    assert list(decisions["switch"]) == ["prefill-1: prefill → decode"] * 2
    assert list(decisions["acted"]) == [True, False]
    assert list(switches["status"]) == ["refused", "done"]
    assert list(switches["detail"]) == [SWITCHES[1][4], SWITCHES[0][4]]


def test_app_planner_page_without_decisions(monkeypatch, tmp_path_factory):
    url = _database(tmp_path_factory, "unplanned", decisions=False)
    page = _tab(_run_app(monkeypatch, url), "Planner")
    assert [i.value for i in page.info] == [planner.NO_DECISIONS]
    title = next(t for t in _figures(page) if t.startswith("Instances per role"))
    traces = {d["name"]: d["y"] for d in _figures(page)[title]["data"]}
    assert set(traces["prefill"]) == {2} and set(traces["decode"]) == {1}


def test_app_planner_page_before_its_migration(monkeypatch, tmp_path_factory):
    url = _database(tmp_path_factory, "old", decisions=False, revision="0005")
    at = _run_app(monkeypatch, url)
    errors = [e.value for e in _tab(at, "Planner").error]
    assert len(errors) == 1 and "have the migrations run?" in errors[0]
    assert _tab(at, "Overview").metric  # the other pages are drawn
