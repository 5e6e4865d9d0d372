"""`halfmoon bench cpp`'s bookkeeping: every layout gets the same prompts, none of them
sharing a token stretch (nothing cached between them), and the table's ratios."""

from __future__ import annotations

from services.tools.bench.cpp import LAYOUTS, prompts, render


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
