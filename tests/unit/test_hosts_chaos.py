"""How `halfmoon cluster chaos` sorts a request's end, scores the throttle, and exits."""

from __future__ import annotations

from services.tools.bench.client import Result
from services.tools.hosts.chaos import FaultReport, HostsChaosSettings, Reports, classify, report
from services.tools.hosts.throttle import ThrottleReport
from shared.settings import settings_from


def result(**kw) -> Result:
    return Result(**kw)


def test_a_broken_connection_is_cut_with_its_exception_as_the_reason() -> None:
    res = result(error="ClientConnectorError: Cannot connect to host 10.0.0.11:8000")
    assert classify(res, 16) == ("cut", "ClientConnectorError")


def test_no_answer_in_time_is_hung() -> None:
    assert classify(result(error="TimeoutError: "), 16) == ("hung", "")


def test_an_error_reply_gives_its_code() -> None:
    err = "{'message': 'no decode instance', 'type': 'server_error', 'code': 'unavailable'}"
    assert classify(result(error=err, terminal=True), 16) == ("error", "unavailable")


def test_completed_needs_every_token() -> None:
    done = result(terminal=True, finish_reason="length", completion_tokens=16)
    assert classify(done, 16) == ("completed", "")
    short = result(terminal=True, finish_reason="length", completion_tokens=15)
    assert classify(short, 16) == ("inconsistent", "")


def test_throttle_scores_only_after_calibration() -> None:
    t = ThrottleReport(100.0, calibrate=2)
    t.rows = [
        {"blocks": 10, "predicted_s": 0.01, "measured_s": 1.0},  # the fast link's guess
        {"blocks": 10, "predicted_s": 0.5, "measured_s": 1.0},
        {"blocks": 10, "predicted_s": 1.1, "measured_s": 1.0},
        {"blocks": 10, "predicted_s": 0.9, "measured_s": 1.0},
        {"blocks": 10, "predicted_s": 1.5, "measured_s": 1.0},
    ]
    s = t.summary()
    assert s["scored"] == 3 and abs(s["median_error"] - 0.1) < 1e-9
    assert s["max_error"] == 0.5 and s["met"]


def test_exit_code_fails_on_a_hung_request_or_a_lost_row(capsys) -> None:
    s = settings_from(HostsChaosSettings, overrides={"faults": "nats-node"})
    ok = FaultReport("nats-node", "x", 3.0, 4, {"completed": 4})
    assert report(Reports([ok]), s) == 0
    hung = FaultReport("nats-node", "x", 3.0, 4, {"completed": 3, "hung": 1})
    assert report(Reports([hung]), s) == 1
    lost = FaultReport("nats-node", "x", 3.0, 4, {"completed": 4}, lost=1)
    assert report(Reports([lost]), s) == 1
    never = FaultReport("nats-node", "x", None, 4, {"completed": 4})
    assert report(Reports([never]), s) == 1
    caught_hung = FaultReport("nats-node", "x", 3.0, 4, {"completed": 4}, caught="hung")
    assert report(Reports([caught_hung]), s) == 1
    assert "nats-node" in capsys.readouterr().err


def test_retries_count_from_zero_on_a_gateway_that_restarted() -> None:
    from services.tools.hosts.chaos import retries_since

    before = [{"stream_lost": 3.0, "no_conductor": 1.0}, {"stream_lost": 5.0}]
    after = [{"stream_lost": 1.0, "no_conductor": 0.0}, {"stream_lost": 7.0}]
    assert retries_since(before, after) == {"stream_lost": 3, "no_conductor": 0}
