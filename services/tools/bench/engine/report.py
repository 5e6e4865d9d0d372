"""The engine bench's tables: every figure next to its bound and its transformers baseline."""

from __future__ import annotations

from typing import Any


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or a != a or b != b:
        return "-"
    return f"{a / b:.2f}x"


def _hf(r: dict[str, Any], name: str, kind: str) -> float | None:
    """transformers' decode tok/s for this precision: its own dtype, or fp32's for int8."""
    p = r["precisions"].get(name, {})
    base = p.get("transformers") or r["precisions"].get("fp32", {}).get("transformers")
    return base[kind]["decode_tok_s"] if base else None


def render(r: dict[str, Any]) -> str:
    """The whole report: the machine, single stream, concurrent requests, int8, and the
    default precision's TBT, prefix reuse, prefill and memory."""
    rows = _machine_rows(r) + [""] + _single_rows(r) + [""] + _batch_rows(r)
    rows += _int8_rows(r) + [""] + _default_rows(r)
    return "\n".join(rows)


def _machine_rows(r: dict[str, Any]) -> list[str]:
    lim, cpu = r["limits"], r["cpu"]
    peaks = ", ".join(f"{k[5:-8]} {v:.0f}" for k, v in lim.items() if k.startswith("peak_"))
    return [
        f"engine bench: {r['model']} on {r['device']}, {r['threads']} threads",
        f"CPU: {cpu['model']} ({cpu['level']}, torch {cpu['torch_capability']}"
        f"{', capped ' + cpu['isa_cap'] if cpu['isa_cap'] != 'native' else ''}); "
        f"kernels: {r['kernels']}",
        f"machine limits (this run): read bandwidth {lim['read_bandwidth_gb_s']:.1f} GB/s; "
        f"peak matmul GFLOP/s: {peaks}",
    ]


def _single_rows(r: dict[str, Any]) -> list[str]:
    rows = [
        f"single stream ({r['workload']['single_prompts']} prompts of 128-512 tokens, one at "
        f"a time, {r['workload']['new_tokens']} new tokens; bounds at the best bandwidth "
        "measured so far in the run)",
        f"{'precision':10}{'step ms':>9}{'tok/s':>8}{'bound ms':>10}{'of bound':>10}"
        f"{'vs generate b1':>16}",
    ]
    for name, p in r["precisions"].items():
        s, b = p["single"], p["single"]["bound"]
        rows.append(
            f"{name:10}{s['step_p50_ms']:>9.1f}{s['decode_tok_s']:>8.1f}"
            f"{b['bound_s'] * 1e3:>10.1f}{b['bound_s'] * 1e3 / s['step_p50_ms']:>9.0%} "
            f"{_ratio(s['decode_tok_s'], _hf(r, name, 'batch1')):>15}"
        )
    for name, p in r["precisions"].items():
        if p.get("transformers"):
            rows.append(
                f"  transformers generate b1, {name}: "
                f"{p['transformers']['batch1']['decode_tok_s']:.1f} tok/s"
            )
    return rows


def _batch_rows(r: dict[str, Any]) -> list[str]:
    n = r["workload"]["batch_requests"]
    rows = [
        f"{n} concurrent requests (prompts {r['workload']['prompt_tokens']} tokens, "
        f"{r['workload']['new_tokens']} new tokens)",
        f"{'precision':10}{'decode tok/s':>13}{'step ms':>9}{'roofline ms':>12}"
        f"{'of roofline':>12}{'vs padded':>11}{'vs b1':>8}",
    ]
    for name, p in r["precisions"].items():
        bt, b = p["batch"], p["batch"]["bound"]
        rows.append(
            f"{name:10}{bt['decode_tok_s']:>13.1f}{bt['full_step_p50_ms']:>9.1f}"
            f"{b['bound_s'] * 1e3:>12.1f}{b['bound_s'] * 1e3 / bt['full_step_p50_ms']:>11.0%} "
            f"{_ratio(bt['decode_tok_s'], _hf(r, name, 'padded')):>10}"
            f"{_ratio(bt['decode_tok_s'], _hf(r, name, 'batch1')):>8}"
        )
    for name, p in r["precisions"].items():
        if p.get("transformers"):
            rows.append(
                f"  transformers generate padded {n}, {name}: "
                f"{p['transformers']['padded']['decode_tok_s']:.1f} tok/s"
            )
    return rows


def _int8_rows(r: dict[str, Any]) -> list[str]:
    """int8 against the other precisions, and its quality gate (nothing without int8)."""
    rows: list[str] = []
    prec = r["precisions"]
    if "int8" in prec:
        i8 = prec["int8"]["single"]["decode_tok_s"]
        rows += [
            "",
            "int8 single stream: "
            + ", ".join(
                f"{_ratio(i8, prec[o]['single']['decode_tok_s'])} {o}"
                for o in ("fp32", "bf16")
                if o in prec
            ),
        ]
    q = r.get("int8_quality")
    if q:
        rows.append(
            f"int8 quality: teacher-forced greedy agreement {q['agreement']:.1%} "
            f"({q['tokens']} tokens, identical prefix {q['identical_prefix']:.0%}); "
            f"perplexity {q['ppl']:.3f} vs fp32 {q['ppl_reference']:.3f} "
            f"({q['ppl_ratio']:.4f}x): {'PASS' if q['passed'] else 'FAIL'}"
        )
    return rows


def _default_rows(r: dict[str, Any]) -> list[str]:
    rows = [
        f"at {r['default_precision']} (the default here):",
        f"{'concurrency':14}{'TBT p50 ms':>12}{'TBT p99 ms':>12}{'decode tok/s':>14}",
    ]
    for c, t in r["tbt"].items():
        rows.append(
            f"{c:14}{t['tbt_p50_ms']:>12.1f}{t['tbt_p99_ms']:>12.1f}{t['decode_tok_s']:>14.1f}"
        )
    pr, pf = r["prefix_reuse"], r["prefill"]
    rows += [
        f"prefix reuse: cold TTFT {pr['cold_ttft_ms']:.0f} ms, 1792/2048 cached "
        f"{pr['warm_ttft_ms']:.0f} ms, ratio {pr['ratio']:.3f}",
        f"prefill {pf['tokens']} tokens: {pf['seconds'] * 1e3:.0f} ms, {pf['gflop_s']:.0f} "
        f"GFLOP/s ({pf['of_peak']:.0%} of peak)",
        f"memory: peak RSS {r['memory']['peak_rss_mib']:.0f} MiB (all precisions' engines)",
    ]
    return rows + _attention_rows(r)


def _attention_rows(r: dict[str, Any]) -> list[str]:
    """Prefill attention: the native paged kernel against gather + SDPA, same threads."""
    if "prefill_attention" not in r:  # a CUDA run: no CPU kernels timed
        return []
    rows = ["prefill attention, one chunk at the end of the context (GFLOP/s):"]
    for dtype, ctxs in r.get("prefill_attention", {}).items():
        for c in ctxs:
            native = (
                f"native {c['native_gflops']:.1f}, {c['native_over_sdpa']:.2f}x"
                if "native_gflops" in c
                else "native: not built here"
            )
            rows.append(
                f"  {dtype:9} {c['context']:>6} tokens: SDPA {c['sdpa_gflops']:.1f}, {native}"
            )
    return rows
