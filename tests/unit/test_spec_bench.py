"""bench spec's arithmetic: rates over whole workloads, and its verdicts."""

from __future__ import annotations

from services.tools.bench import spec_bench


def _row(out: int, plain: float, spec: float, same: int, spec_out: int | None = None) -> dict:
    return {
        "prompt_tokens": 50,
        "output_tokens": out,
        "spec_output_tokens": spec_out or out,
        "plain_tok_s": plain,
        "spec_tok_s": spec,
        "drafted": 40,
        "accepted": 30,
        "same_tokens": same,
    }


def test_rates_are_tokens_over_summed_seconds_and_identical_outputs_are_counted():
    # 100 tokens in 1 s and 2 s plain; 0.5 s and 0.5 s drafted -> 200/3 vs 200/1 tok/s.
    rows = [_row(101, 100.0, 200.0, 101), _row(101, 50.0, 200.0, 40)]
    w = spec_bench.summarize(rows)
    assert abs(w["plain_tok_s"] - 200 / 3) < 1e-9 and abs(w["spec_tok_s"] - 200.0) < 1e-9
    assert abs(w["ratio"] - 3.0) < 1e-9
    assert w["acceptance"] == 60 / 80 and w["identical"] == 1
    text = spec_bench.render(
        {
            "machine": "cpu",
            "dtype": "bfloat16",
            "threads": 2,
            "num_speculative_tokens": 4,
            "workloads": {"grounded": w, "fresh": spec_bench.summarize([_row(11, 10.0, 9.0, 11)])},
        }
    )
    assert "3.00x      75%" in text and "met (>= 1.5x); 1 of 2 outputs identical" in text
    assert "0.90x" in text and "NOT MET (>= 0.95x)" in text
