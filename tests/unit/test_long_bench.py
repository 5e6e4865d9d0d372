"""`halfmoon bench long`'s verdicts and table: each figure judged against its target on
the right side (lower is better for ratios of time, higher for a share of the bound)."""

from __future__ import annotations

import json

import pytest

from services.tools.bench import cpp, long


def test_each_target_is_judged_on_its_side():
    assert long.verdict("reuse", 0.155).startswith("met")
    assert long.verdict("reuse", 0.17).startswith("NOT MET")
    assert long.verdict("decode", 0.61).startswith("met")  # a share: higher is better
    assert long.verdict("decode", 0.59).startswith("NOT MET")
    assert long.verdict("handoff", 1.5).startswith("met")
    assert long.verdict("cpp", 0.61).startswith("NOT MET")


def test_the_table_prints_every_part_with_its_verdict():
    one, group, both = cpp.LAYOUTS
    layouts = {one: {"16384": [100.0]}, group: {"16384": [55.0]}, both: {"16384": [54.0]}}
    rounds = [{"warm_ttft_ms": 600.0, "cold_ttft_ms": 4000.0, "ratio": 0.15}] * 3
    result = {
        "machine": "a CPU, 2 cores, avx2",
        "parts": {
            "attention": {
                "dtype": "float32",
                "rows": [
                    {
                        "context": 2048,
                        "sdpa_gflops": 100.0,
                        "native_gflops": 150.0,
                        "native_over_sdpa": 1.5,
                    }
                ],
                "engine_runs": "native paged kernel",
            },
            "reuse": {"rounds": rounds, "value": 0.15},
            "decode": {
                "tokens": 32000,
                "decode_step_ms": 20.0,
                "decode_bound_ms": 13.0,
                "read_bandwidth_gb_s": 20.0,
                "value": 0.65,
            },
            "handoff": {
                "table": "(handoff table)",
                "value": 1.8,
                "rows": [
                    {"prompt_tokens": 2048, "streamed_gap_ms": 70.0, "streamed_later_gap_ms": 30.0},
                    {
                        "prompt_tokens": 32000,
                        "streamed_gap_ms": 150.0,
                        "streamed_later_gap_ms": 100.0,
                    },
                ],
            },
            "cpp": {"cpus": "0-1", "dtype": "auto", "layouts": layouts, "value": 0.55},
        },
    }
    text = long.render(result)
    assert "native  150.0, SDPA  100.0 (1.50x)" in text
    assert "the engine runs: native paged kernel" in text
    assert "-> 0.150x  met (<= 0.16)" in text
    assert "-> 65% of the bound  met (>= 0.6)" in text
    assert "1.80x  NOT MET (<= 1.5)" in text
    assert "2048: 40.0, 32000: 50.0 -> largest / smallest 1.25x" in text
    assert "0.55x  met (<= 0.6)" in text


def test_an_unknown_part_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        long.main(["--parts", "attention,speed"])
    assert "unknown parts ['speed']" in capsys.readouterr().err


def test_the_pool_holds_the_largest_prompt_twice_in_fp32(tmp_path):
    """A 2 GiB pool refused the 32k handoff prompt (2,001 blocks) on an fp32 machine."""
    config = {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, every layer, fp32
    gb = long.pool_gb(tmp_path, 32000, None)
    assert gb * 2**30 >= 2 * 32000 * per_token and gb % 0.25 == 0
    assert long.pool_gb(tmp_path, 32000, 1.5) == 1.5  # asked for: as asked
    assert long.pool_gb(tmp_path, 100, None) == 1.0  # never under 1 GiB


def test_a_failed_part_is_recorded_and_the_rest_still_run(monkeypatch, tmp_path):
    def broken(args):
        raise RuntimeError("429 rejected: no decode instance with room")

    monkeypatch.setitem(long.RUNNERS, "handoff", broken)
    monkeypatch.setitem(long.RUNNERS, "reuse", lambda args: {"rounds": ROUNDS, "value": 0.15})
    out = tmp_path / "long.json"
    rc = long.main(["--parts", "handoff,reuse", "--json-out", str(out)])
    saved = json.loads(out.read_text())
    assert rc == 1
    assert "429 rejected" in saved["parts"]["handoff"]["error"]
    assert saved["parts"]["reuse"]["value"] == 0.15  # measured after the failure
    assert "handoff: FAILED" in long.render(saved)


ROUNDS = [{"warm_ttft_ms": 600.0, "cold_ttft_ms": 4000.0, "ratio": 0.15}] * 3
