"""The elastic P/D planner's rule (services/conductor/planner.py): the forecast, the goodput
estimate of a split, and when it switches an instance (hysteresis, cooldown, the minimum
per role, the least drain), all pure."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from services.conductor.costmodel import CostModel
from services.conductor.planner import (
    Planner,
    PlannerSettings,
    attainment,
    decision_record,
    drain_s,
    estimate,
    forecast,
)
from services.conductor.planner_types import (
    Arrival,
    Finished,
    Forecast,
    InstanceLoad,
    PlannerInputs,
)

COST = CostModel()  # SmolLM2-135M on a CPU core: a 1k-token prefill ~1.9 s
DOCS = Forecast(rate_per_s=6.0, prompt_tokens=1_000, cached_tokens=0, output_tokens=16)
CHATS = Forecast(rate_per_s=6.0, prompt_tokens=100, cached_tokens=0, output_tokens=500)
TTFT, TBT = 5.0, 0.1


def loads(prefill: int, decode: int) -> tuple[InstanceLoad, ...]:
    p = [InstanceLoad(f"p{i}", "prefill") for i in range(prefill)]
    d = [InstanceLoad(f"d{i}", "decode") for i in range(decode)]
    return tuple(p + d)


def inputs(
    instances: tuple[InstanceLoad, ...], fc: Forecast = DOCS, now: float = 100.0
) -> PlannerInputs:
    return PlannerInputs(now, instances, fc, None, TTFT, TBT)


def active(**kw: object) -> Planner:
    return Planner(PlannerSettings(mode="active", **kw))  # type: ignore[arg-type]


# ---- forecast ----------------------------------------------------------------------------------


def even(rate: float, start: float, end: float, prompt: int = 100) -> list[Arrival]:
    n = round(rate * (end - start))
    return [Arrival(start + (k + 0.5) * (end - start) / n, prompt, 0, 50) for k in range(n)]


def test_forecast_is_the_windows_mean_without_a_clear_trend():
    fc = forecast(even(4.0, 70, 100), [], now_s=100, window_s=30)
    assert fc.rate_per_s == pytest.approx(4.0)
    assert fc.prompt_tokens == 100 and fc.output_tokens == 50  # max_tokens: none finished


def test_forecast_follows_a_clear_trend_and_never_goes_below_zero():
    rising = even(2.0, 70, 85) + even(6.0, 85, 100)
    fc = forecast(rising, [], now_s=100, window_s=30)
    assert fc.rate_per_s == pytest.approx(8.0)  # r2 + (r2 - r1) / 15 s * 7.5 s
    later = forecast(rising, [], now_s=100, window_s=30, ahead_s=7.5)
    assert later.rate_per_s == pytest.approx(10.0)
    falling = even(6.0, 70, 85) + even(0.4, 85, 100)
    assert forecast(falling, [], now_s=100, window_s=30, ahead_s=30).rate_per_s == 0.0


def test_forecast_outputs_come_from_finished_requests_rejected_ones_aside():
    arrivals = even(2.0, 80, 100)
    finished = [Finished(95, 400, True), Finished(96, 200, False), Finished(97, 0, False)]
    finished.append(Finished(10, 9_999, True))  # outside the window
    fc = forecast(arrivals, finished, now_s=100, window_s=30)
    assert fc.output_tokens == pytest.approx(300)
    assert attainment(finished[:3]) == pytest.approx(1 / 3)
    assert attainment([]) is None


# ---- estimate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fc", [DOCS, CHATS])
def test_estimate_is_monotonic_in_each_pool(fc: Forecast):
    for d in (1, 4, 8):
        goodputs = [estimate(COST, fc, p, d, TTFT, TBT).goodput_rps for p in range(1, 16)]
        ttfts = [estimate(COST, fc, p, d, TTFT, TBT).ttft_s for p in range(1, 16)]
        assert goodputs == sorted(goodputs) and ttfts == sorted(ttfts, reverse=True)
    for p in (1, 4, 8):
        goodputs = [estimate(COST, fc, p, d, TTFT, TBT).goodput_rps for d in range(1, 16)]
        tbts = [estimate(COST, fc, p, d, TTFT, TBT).tbt_s for d in range(1, 16)]
        assert goodputs == sorted(goodputs) and tbts == sorted(tbts, reverse=True)
    big = estimate(COST, fc, 32, 32, TTFT, TBT)
    assert big.goodput_rps == fc.rate_per_s  # never more than arrives


def test_overload_is_inf_and_caps_the_goodput():
    docs = estimate(COST, DOCS, 2, 14, TTFT, TBT)  # 2 instances of ~1.9 s prefills: ~1 req/s
    assert docs.ttft_s == math.inf and docs.tbt_s < TBT
    assert 0.5 < docs.goodput_rps < 1.1
    chats = estimate(COST, CHATS, 14, 2, TTFT, TBT)
    assert chats.tbt_s == math.inf and chats.ttft_s < TTFT
    assert 0 < chats.goodput_rps < 2.0
    # The TTFT SLO below one prefill: nothing meets it, however many instances.
    assert estimate(COST, DOCS, 16, 16, 1.0, TBT).goodput_rps == 0.0


def test_a_small_kv_pool_limits_decode():
    free = estimate(COST, CHATS, 8, 8, TTFT, TBT)
    tight = estimate(COST, CHATS, 8, 8, TTFT, TBT, kv_blocks_per_decode=4 * 38)  # 4 sequences
    assert tight.goodput_rps < free.goodput_rps / 3


# ---- deciding ----------------------------------------------------------------------------------


def test_switches_one_instance_of_the_shrinking_role_towards_the_best_split():
    d = active().decide(inputs(loads(8, 8)), COST)
    assert d.current == (8, 8) and d.best == (12, 4)  # documents: the closest that serves all
    assert d.switch is not None
    assert (d.switch.from_role, d.switch.to_role) == ("decode", "prefill")
    assert d.reason.startswith("prefill short: 8P+8D serves")
    assert len(d.estimates) == 15  # 1..15 prefill instances weighed


def test_the_instance_with_the_least_drain_switches():
    busy = [InstanceLoad(f"d{i}", "decode", running=10 - i, mean_context=600) for i in range(4)]
    idle = [InstanceLoad(f"p{i}", "prefill") for i in range(4)]
    d = active().decide(inputs(tuple(idle + busy)), COST)
    assert d.switch is not None and d.switch.instance_id == "d3"  # 7 sequences, the fewest
    assert d.switch.drain_s == pytest.approx(drain_s(COST, DOCS, busy[3]))
    queued = [InstanceLoad(f"p{i}", "prefill", queue_s=5.0 - i) for i in range(8)]
    d = active().decide(inputs(tuple(queued) + loads(0, 2), fc=CHATS), COST)
    assert d.switch is not None and d.switch.instance_id == "p7"  # 1 s of queue, the least


def test_serving_the_forecast_it_holds_even_where_another_split_is_less_loaded():
    d = active().decide(inputs(loads(14, 2)), COST)
    assert d.switch is None and d.best == (14, 2)  # ties: the split closest to the current
    assert "the best split" in d.reason


def test_no_switch_while_one_is_under_way():
    moving = replace(loads(0, 1)[0], instance_id="d9", switching=True)
    d = active().decide(inputs((*loads(8, 8), moving)), COST)
    assert d.current == (8, 8) and d.switch is None and "d9 is switching" in d.reason


def test_cooldown_after_a_switch():
    planner = active(cooldown_s=15.0)
    assert planner.decide(inputs(loads(8, 8), now=100.0), COST).switch is not None
    held = planner.decide(inputs(loads(9, 7), now=105.0), COST)
    assert held.switch is None and "cooldown, 10 s left" in held.reason
    assert planner.decide(inputs(loads(9, 7), now=115.0), COST).switch is not None


def test_never_below_the_minimum_per_role():
    busy = replace(DOCS, rate_per_s=7.5)  # 15 prefill instances would serve more than 14
    d = active().decide(inputs(loads(14, 2), fc=busy), COST)
    assert d.best == (15, 1) and d.switch is not None
    d = active(min_per_role=2).decide(inputs(loads(14, 2), fc=busy), COST)
    assert d.best == (14, 2) and d.switch is None
    assert all(e.decode >= 2 and e.prefill >= 2 for e in d.estimates)


def test_a_drain_longer_than_the_horizon_never_pays():
    # Documents on 8:8: a decode instance must go, but each holds 40 sequences of 1k
    # tokens, ~2.3 s to finish.
    busy = tuple(InstanceLoad(f"d{i}", "decode", running=40, mean_context=1_000) for i in range(8))
    seen = inputs(loads(8, 0) + busy)
    assert 2.0 < drain_s(COST, DOCS, busy[0]) < 3.0
    held = active(horizon_s=2.0).decide(seen, COST)
    assert held.switch is None and "do not pay for d0's 2.3 s drain" in held.reason
    assert active(horizon_s=60.0).decide(seen, COST).switch is not None


@pytest.mark.parametrize("split", [(8, 8), (14, 2), (3, 13), (12, 4)])
@pytest.mark.parametrize("fc", [DOCS, CHATS])
def test_the_mode_never_changes_the_decision(split: tuple[int, int], fc: Forecast):
    seen = inputs(loads(*split), fc=fc)
    a = Planner(PlannerSettings(mode="active")).decide(seen, COST)
    b = Planner(PlannerSettings(mode="advisory")).decide(seen, COST)
    assert (a.mode, b.mode) == ("active", "advisory")
    assert replace(a, mode="advisory") == b


def test_off_weighs_nothing():
    d = Planner(PlannerSettings()).decide(inputs(loads(8, 8)), COST)
    assert d.mode == "off" and d.switch is None and d.reason == "planner off"
    assert d.estimates == () and d.best == d.current == (8, 8)


def test_the_record_is_plain_json_without_inf():
    d = active().decide(inputs(loads(2, 14)), COST)  # documents: prefill overloaded
    rec = decision_record(replace(d, acted=True))
    text = json.dumps(rec, allow_nan=False)  # raises on inf or nan
    assert rec["acted"] is True and rec["switch_from"] == "decode"
    assert rec["current_prefill"] == 2 and rec["best_prefill"] == 12
    assert any(e["ttft_s"] is None for e in rec["estimates"])
    assert rec["forecast"]["rate_per_s"] == 6.0 and len(rec["instances"]) == 16
    assert set(rec) >= {"created", "mode", "drain_s", "reason", "attainment"} and text


def test_colocated_instances_stay_where_they_are():
    """Colocated instances (put there by hand) are neither counted in a split nor moved:
    the planner decides over the prefill and decode instances alone."""
    mixed = loads(8, 8) + tuple(InstanceLoad(f"c{i}", "colocated") for i in range(3))
    d = active().decide(inputs(mixed), COST)
    plain = active().decide(inputs(loads(8, 8)), COST)
    assert (d.current, d.best, d.estimates) == (plain.current, plain.best, plain.estimates)
    assert d.switch is not None and not d.switch.instance_id.startswith("c")
