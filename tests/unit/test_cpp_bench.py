"""`halfmoon bench cpp`'s bookkeeping: every layout gets the same prompts, none of them
sharing a token stretch (nothing cached between them), and the table's ratios."""

from __future__ import annotations

import json

from services.tools.bench.cpp import LAYOUTS, idle_since, prompts, render
from services.tools.decisions import stages_of


def test_prompts_are_disjoint_stretches_of_the_text():
    ids = list(range(100))
    work = prompts(ids, [10, 20], 2)
    assert [len(p) for p in work[10] + work[20]] == [10, 10, 20, 20]
    flat = [t for ps in work.values() for p in ps for t in p]
    assert len(flat) == len(set(flat)) == 60


def test_the_table_gives_each_layout_against_one_instance_on_one_core():
    one, group, both = LAYOUTS
    r = {
        "cpus": "0-1",
        "dtype": "auto",
        "layouts": {one: {"8192": [40.0, 42.0]}, group: {"8192": [22.0]}, both: {"8192": [24.0]}},
    }
    row = render(r).splitlines()[-1].split()
    assert row[0] == "8192" and row[-2:] == ["0.54", "0.59"]  # median 41 against 22 and 24


def test_the_placement_is_read_from_the_chosen_candidate_of_the_decision():
    single = {"instance": "prefill-0", "ttft_ms": 2005.4}
    group = {"instance": "prefill-0", "ttft_ms": 1579.9, "stages": [{"i": 0}, {"i": 1}]}
    record = json.dumps([single, group])
    assert stages_of(1579.9, record) == 2  # both start on prefill-0: the time tells
    assert stages_of(2005.4, record) == 1
    assert stages_of(2005.4, [single, group]) == 1  # the column as SQLAlchemy reads it
    assert stages_of(999.0, record) == 0
    assert stages_of(None, "[]") == 0  # refused: no prediction recorded


def test_a_prompt_waits_for_a_heartbeat_after_the_last_one_that_shows_the_instance_idle():
    idle = {"sent_at": 10.5, "queue_depth": 0, "running": 0, "queue_prompts": []}
    assert idle_since(idle, since=10.0)
    assert not idle_since(idle, since=11.0)  # sent before: it may predate the last prompt
    assert not idle_since({**idle, "running": 1}, since=10.0)
    assert not idle_since({**idle, "queue_depth": 1, "queue_prompts": [900]}, since=10.0)
