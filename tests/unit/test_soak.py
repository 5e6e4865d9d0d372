"""The soak's judgement of growth: a least-squares slope over the second half of a run,
against a tolerance relative to the series' mean (with an absolute floor)."""

from __future__ import annotations

import random

import pytest

from services.tools.soak.args import parse_args
from services.tools.soak.growth import judge, runtime_bounded, slope, table
from services.tools.soak.sample import go_memstats


def test_slope_is_the_least_squares_fit():
    assert slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert slope([(0, 5.0)]) == 0.0 and slope([(1, 2.0), (1, 4.0)]) == 0.0
    rng = random.Random(7)
    noisy = [(t, 100.0 + 0.5 * t + rng.gauss(0, 1)) for t in range(200)]
    assert slope(noisy) == pytest.approx(0.5, abs=0.02)


def test_a_flat_noisy_rss_passes_and_a_leak_of_ten_percent_fails():
    rng = random.Random(1)
    flat = [(t, 300.0 + rng.gauss(0, 3)) for t in range(0, 3600, 10)]
    g = judge("decode-0 (pid 1)", "rss_mib", flat, 1800, 3600)
    assert g.judged and g.ok and abs(g.per_hour) < 15
    leak = [(t, 300.0 + 30.0 * t / 1800) for t in range(0, 3600, 10)]  # +10% per half
    g = judge("decode-0 (pid 1)", "rss_mib", leak, 1800, 3600)
    assert not g.ok and g.per_hour == pytest.approx(60.0)
    assert "GROWS" in table([g])


def test_bursts_above_a_flat_floor_are_no_leak_but_a_rising_floor_is():
    # A Go heap between collections: a flat 24 MiB floor, with spikes that come more often
    # late in the window (a busier spell). A fit through every sample calls it growth.
    def heap(t: int) -> float:
        every = 120 if t < 2700 else 20
        return 24.0 + (8.0 if t % every == 0 else 0.0)

    bursty = [(t, heap(t)) for t in range(1800, 3600, 10)]
    g = judge("nats-server (pid 1)", "rss_mib", bursty, 1800, 3600)
    assert g.raw_per_hour * 0.5 > g.allowed  # the raw fit would have failed it
    assert g.ok and g.per_hour == pytest.approx(0.0)
    # The same spikes over a floor that rises 3 MiB across the half: a leak, and judged so.
    rising = [(t, v + 3.0 * (t - 1800) / 1800) for t, v in bursty]
    g = judge("nats-server (pid 1)", "rss_mib", rising, 1800, 3600)
    assert not g.ok and g.over_window == pytest.approx(3.0, abs=0.2)


def test_only_the_window_counts_and_a_warm_up_before_it_does_not():
    warm = [(t, 100.0 + t) for t in range(0, 1800, 10)] + [
        (t, 1900.0) for t in range(1800, 3600, 10)
    ]
    assert judge("p", "fds", warm, 1800, 3600).ok


def test_small_counts_have_an_absolute_floor_and_too_few_points_are_not_judged():
    threads = [(t, 20.0 + (t > 3000)) for t in range(1800, 3600, 10)]  # one more worker
    assert judge("p", "threads", threads, 1800, 3600).ok
    growing = [(t, 20.0 + t / 100) for t in range(1800, 3600, 10)]  # +18 threads per half
    assert not judge("p", "threads", growing, 1800, 3600).ok
    few = judge("p", "fds", [(1900, 1.0), (2000, 90.0)], 1800, 3600)
    assert not few.judged and few.ok
    late = [(t, 100.0 + t) for t in range(3000, 3600, 10)]  # restarted late: a third covered
    assert not judge("p", "rss_mib", late, 1800, 3600).judged


def _go_process(rss_rise: float, sys_rise: float, anon_end: float):
    """A nats-server's judged series over the second half: RSS and private RSS rising by
    `rss_rise`, Go's Sys by `sys_rise`, private RSS ending at `anon_end`."""
    ts = range(1800, 3600, 10)

    def ramp(start: float, rise: float) -> list[tuple[float, float]]:
        return [(t, start + rise * (t - 1800) / 1790) for t in ts]

    name = "nats-server (pid 9)"
    return runtime_bounded(
        [
            judge(name, "rss_mib", ramp(anon_end + 13.6 - rss_rise, rss_rise), 1800, 3600),
            judge(name, "rss_anon_mib", ramp(anon_end - rss_rise, rss_rise), 1800, 3600),
            judge(name, "go_sys_mib", ramp(21.2, sys_rise), 1800, 3600),
            judge("decode-0 (pid 3)", "rss_mib", ramp(300.0, 40.0), 1800, 3600),
        ]
    )


def test_a_go_processs_rss_is_bounded_while_its_runtime_holds_no_more():
    rss, anon, go_sys, other = _go_process(rss_rise=2.6, sys_rise=0.0, anon_end=14.4)
    assert not 0 < rss.over_window <= rss.allowed  # past the RSS rule on its own
    assert rss.ok and anon.ok and "within Go's flat Sys 21.2" in rss.bounded_by
    assert go_sys.ok and not go_sys.bounded_by and not go_sys.judged
    assert not other.ok and not other.bounded_by  # no runtime accounting: judged as is
    assert "bounded: private RSS 14.4" in table([rss])


def test_a_go_process_that_takes_more_from_the_os_or_outgrows_it_is_growth():
    rss, anon, go_sys, _ = _go_process(rss_rise=6.0, sys_rise=6.0, anon_end=20.0)
    assert not rss.ok and not anon.ok  # the runtime took more from the OS: no bound
    assert go_sys.ok and not go_sys.judged  # a high-water mark is shown, never judged
    assert "high-water mark, not judged (rose +6.0)" in table([go_sys])
    rss, anon, _, _ = _go_process(rss_rise=4.0, sys_rise=0.0, anon_end=25.0)
    assert not rss.ok and not anon.ok  # private RSS past Sys: not the runtime's pages


def test_go_memstats_reads_a_heap_profiles_numbers():
    text = "heap profile: 1: 2 [3: 4] @ heap/1048576\n# Sys = 22233088\n# HeapAlloc = 5242880\n"
    text += "# PauseNs = [0 0 0]\n# DebugGC = false\n"
    assert go_memstats(text) == {"Sys": 22233088.0, "HeapAlloc": 5242880.0}


def test_retention_defaults_to_a_quarter_of_the_run():
    assert parse_args(["--minutes", "60"]).retention == 900.0
    assert parse_args(["--minutes", "2"]).retention == 60.0
    assert parse_args(["--minutes", "60", "--retention-s", "120"]).retention == 120.0
    with pytest.raises(SystemExit):
        parse_args(["--targets", "gateway"])


def _saved(sys_step_at: float, rss_end: float) -> dict:
    """A saved report of a 60-minute run: nats-server's Sys steps up once (a new heap
    peak) at `sys_step_at` s, its RSS runs flat at 30 MiB and ends at `rss_end`."""
    ts = [float(t) for t in range(120, 3600, 10)]
    name = "nats-server (pid 9)"
    samples = {
        f"{name} | go_sys_mib": [[t, 21.3 if t < sys_step_at else 25.3] for t in ts],
        f"{name} | go_heap_mib": [[t, 6.0 + (t % 60) / 20] for t in ts],
        f"{name} | rss_mib": [[t, 30.0 if t < 3500 else rss_end] for t in ts],
        f"{name} | rss_anon_mib": [[t, 15.0] for t in ts],
    }
    return {
        "settings": {"minutes": 60.0},
        "wall_s": 3600.0,
        "retention_s": 900.0,
        "outcomes": {"completed": 10},
        "examples": {},
        "records_lost": 0,
        "records_lost_ids": [],
        "kills": [],
        "growth": [],
        "table": "",
        "samples": samples,
    }


def test_a_saved_report_is_judged_again_from_its_samples():
    from services.tools.soak.run import failed, rejudge

    # Sys stepped up in the second half and stayed: a new peak, not a leak (heap, RSS flat).
    r = rejudge(_saved(sys_step_at=2250.0, rss_end=30.0), 3600.0)
    assert not failed(r)
    assert "high-water mark, not judged (rose" in r["table"]
    assert {g["kind"] for g in r["growth"] if g["judged"]} == {
        "go_heap_mib",
        "rss_mib",
        "rss_anon_mib",
    }
    # The RSS floor rising past the rule with Sys rising too is growth, as in a live run.
    leak = _saved(sys_step_at=2250.0, rss_end=40.0)
    leak["samples"]["nats-server (pid 9) | rss_mib"] = [
        [t, 30.0 + (t - 1800) / 180 if t > 1800 else 30.0]
        for t, _ in leak["samples"]["nats-server (pid 9) | rss_mib"]
    ]
    assert failed(rejudge(leak, 3600.0))
