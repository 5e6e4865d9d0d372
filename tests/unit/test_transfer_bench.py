"""`halfmoon bench transfer`'s arithmetic: every ratio is end to end, the sender's offer
(its copy into the buffer it sends from) included, and the plain copy shows no offer."""

from __future__ import annotations

import pytest

from services.tools.bench import transfer_bench as tb

MIB = 64


def results(times_ms: dict[str, tuple[float, float]]) -> dict[str, dict]:
    """mode -> (offer ms, fetch ms), the same in each of three rounds."""
    return {
        m: tb._summary(MIB << 20, [o / 1e3] * 3, [f / 1e3] * 3) for m, (o, f) in times_ms.items()
    }


TIMES = {
    "plain": (0, 50),
    "plain_reused": (0, 20),
    "tcp": (5, 45),
    "tcp_reused": (5, 20),
    "shm": (35, 10),
    "shm_copy": (35, 40),
}


def test_end_to_end_is_offer_plus_fetch():
    r = results(TIMES)
    assert r["shm"]["fetch_mib_s"]["median"] == pytest.approx(MIB / 0.010)
    assert r["shm"]["end_to_end_mib_s"]["median"] == pytest.approx(MIB / 0.045)
    assert r["plain"]["end_to_end_mib_s"] == r["plain"]["fetch_mib_s"]  # it has no offer


def test_every_ratio_counts_the_senders_copy():
    rat = tb._ratios(results(TIMES), tb.RATIOS)
    # shm fetches 4.5x faster than tcp, but its 35 ms segment write makes it 50 / 45 end to end
    assert rat["shm_over_tcp"]["median"] == pytest.approx(50 / 45)
    assert rat["shm_over_tcp"]["target"] == 2.0 and rat["shm_over_tcp"]["met"] is False
    assert rat["tcp_over_plain"]["median"] == pytest.approx(50 / 50)
    assert rat["tcp_over_plain"]["met"] is True
    assert rat["shm_copy_over_tcp"]["best"] == pytest.approx(50 / 75)
    assert all("end_to_end_mib_s" in r["of"] for r in rat.values())
    assert set(rat) == set(tb.RATIOS)


def test_table_has_no_offer_for_the_plain_copy():
    res = results(TIMES)
    doc = {
        "mib": MIB,
        "rounds": 3,
        "frame_kib": 1024,
        "setup": {"loadavg_at_start": (0.5,)},
        "results": res,
        "ratios": tb._ratios(res, tb.RATIOS),
    }
    lines = {line.split()[0]: line for line in tb.render_table(doc).splitlines()}
    assert "-" in lines["plain"].split() and "35.0" in lines["shm"]
    assert "end to end" in tb.render_table(doc)
    assert "NOT met" in lines["shm_over_tcp"]
