"""bench replay --compare decode-reuse's arithmetic: the decode instances' handoff traffic
from /admin/state, and the verdict (the drop in bytes per handoff against the share of
the prompts' KV decode held)."""

from __future__ import annotations

from services.tools.bench.replay.reuse import Handoffs, comparison


def state(*activities: dict, prefill: dict | None = None) -> dict:
    instances = [{"role": "decode", "kv_activity": a} for a in activities]
    instances.append({"role": "prefill", "kv_activity": prefill or {"handoff_bytes": 999}})
    return {"instances": instances}


def test_decode_instances_handoffs_are_added_up_and_prefill_ones_left_out():
    s = state(
        {"handoffs": 3, "handoff_bytes": 300, "handoff_held_bytes": 100},
        {"handoffs": 1, "handoff_bytes": 100},
    )
    assert Handoffs.of(s) == Handoffs(4, 400, 100)
    moved = Handoffs.of(s) - Handoffs(1, 100, 0)
    assert moved.per_handoff() == 100.0 and moved.held_share() == 0.25
    assert Handoffs().per_handoff() is None and Handoffs().held_share() is None


def run(name: str, moved: Handoffs, texts: tuple[str, ...] = ("a", "b")) -> dict:
    records = [{"index": i, "status": "completed", "text": t} for i, t in enumerate(texts)]
    return {"name": name, "handoffs": moved.as_json(), "records": records}


def test_the_drop_must_match_the_held_share_within_five_points():
    # Without reuse 1000 bytes a handoff; with it 600 moved and 400 held: a 40% drop.
    (met,) = comparison(
        [run("reuse", Handoffs(10, 6000, 4000)), run("no_reuse", Handoffs(10, 10000, 0))]
    )
    assert met["met"] and abs(met["drop"] - 0.4) < 1e-9 and met["held_share"] == 0.4
    # Held 40%, but the bytes fell only 30%: something moved that decode held.
    (missed,) = comparison(
        [run("reuse", Handoffs(10, 7000, 4000)), run("no_reuse", Handoffs(10, 10000, 0))]
    )
    assert not missed["met"] and "NOT met" in missed["text"]


def test_no_verdict_without_both_runs_and_a_failed_one_without_handoffs():
    assert comparison([run("reuse", Handoffs(1, 1, 0))]) == []
    (none,) = comparison([run("reuse", Handoffs()), run("no_reuse", Handoffs(1, 5, 0))])
    assert not none["met"]


def test_the_answers_of_requests_completed_in_both_runs_are_compared():
    on = run("reuse", Handoffs(2, 6, 4), ("a", "b", "c"))
    on["records"][2]["status"] = "failed"
    (verdict,) = comparison([on, run("no_reuse", Handoffs(2, 10, 0), ("a", "x", "c"))])
    assert (verdict["same_answers"], verdict["compared"]) == (1, 2)
    assert "1 of 2" in verdict["text"] and not verdict["met"]  # the bytes alone would pass
