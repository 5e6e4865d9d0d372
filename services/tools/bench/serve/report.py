"""`bench serve`'s text report: the banner (what ran where) and one table per prompt mode and
concurrency level, each system against Halfmoon at the same precision."""

from __future__ import annotations

from typing import Any


def _prompts_line(mode: str, seed: str) -> str:
    if mode == "fresh":
        return (
            "fresh: every round and the warm-up send prompts never sent before "
            f"(seed {seed}); no prefix cache can serve them"
        )
    if mode == "grounded":
        return (
            "grounded: answers that copy their prompt (repeat or edit a function of Python's "
            "standard library), each prompt led by a system message of its own, so no prefix "
            f"cache serves them (seed {seed}); where prompt-lookup speculation finds drafts"
        )
    return (
        "fixed (cache-friendly): the same prompts every round, warm-up included, so a "
        "prefix cache serves the repeats"
    )


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def _system_line(name: str, s: dict[str, Any]) -> str:
    p = s["placement"]
    if p is None:
        return f"  {name:24} external: not started nor pinned here; prefix cache unknown"
    unit = "engine" if name.startswith("halfmoon") else "process"
    line = (
        f"  {name:24} {_count(p['processes'], unit)} x {_count(p['threads'], 'thread')} "
        f"({p['total_threads']} in total, OMP_NUM_THREADS={s['env']['OMP_NUM_THREADS']}) "
        f"on cpus {p['cpus']}; {s['precision_flags']}"
    )
    if "llama_cpp" in s:
        t = p["total_threads"]
        line += (
            f"; --threads {t} --threads-batch {t}, --parallel = the concurrency "
            f"(started again at each level), --ctx-size = parallel x {s['llama_cpp']['slot_ctx']}"
            ", --cont-batching --cache-prompt, cache_prompt and ignore_eos in each request"
        )
    return line + f"; prefix cache: {s['prefix_cache']}"


def _observed_line(name: str, s: dict[str, Any]) -> str:
    seen = s.get("observed") or []
    want = s["placement"]["cpus"]
    off = [p for p in seen if p["cpus"] != want]
    procs = ", ".join(f"{p['name']} ({p['os_threads']} thr, nice {p['nice']})" for p in seen)
    verdict = (
        f"all on cpus {want}"
        if not off
        else "NOT all pinned: " + ", ".join(f"{p['name']} on {p['cpus']}" for p in off)
    )
    return f"  {name:24} {_count(len(seen), 'process')}, {verdict}: {procs}"


def banner(setup: dict[str, Any]) -> str:
    rows = [
        "what ran where",
        f"  cpus     {setup['cpus']} ({setup['cpu_count']} of {setup['machine_cpus']} on this "
        f"machine, {setup['cpu_model']}): every process of every system started here is "
        "pinned to them",
        f"  precision {', '.join(setup['precisions'])} ({setup['precisions_why']}); each "
        "system at each it has, compared with Halfmoon at the same one",
    ]
    rows += [f"  skipped  {line}" for line in setup["skipped"]]
    rows += [f"  prompts  {_prompts_line(m, setup['prompt_seed'])}" for m in setup["prompts"]]
    rows.append(
        f"  client   this process (pid {setup['client']['pid']}), cpus "
        f"{setup['client']['cpus']}, not pinned"
    )
    rows += [_system_line(name, s) for name, s in setup["systems"].items()]
    observed = [(n, s) for n, s in setup["systems"].items() if s.get("observed")]
    if observed:
        rows.append("read back from /proc after the runs")
        rows += [_observed_line(n, s) for n, s in observed]
    return "\n".join(rows)


# --- the tables ------------------------------------------------------------------------


def _ratio(base: dict[str, Any], r: dict[str, Any]) -> str:
    if not (r["output_tok_s"] and r["ttft_p50_ms"] and r["itl_p99_ms"]):
        return "n/a: nothing measured"
    return (
        f"{base['output_tok_s'] / r['output_tok_s']:.2f}x tok/s, TTFT p50 "
        f"{base['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x, ITL p99 "
        f"{base['itl_p99_ms'] / r['itl_p99_ms']:.2f}x"
    )


def _cached(r: dict[str, Any], s: dict[str, Any]) -> str:
    """Share of prompt tokens served from cache, where the server reports it truthfully."""
    known = s.get("reports_cached_tokens") or r["cached_tokens"] > 0
    return f"{r['cached_tokens'] / r['prompt_tokens']:.0%}" if known and r["prompt_tokens"] else "-"


def halfmoon_at(report: dict[str, Any], precision: str) -> list[str]:
    """The names of the Halfmoon runs (one per layout) at `precision`."""
    return [
        name
        for name, s in report["setup"]["systems"].items()
        if name.startswith("halfmoon")
        and s.get("precision") == precision
        and name in report["systems"]
    ]


def _vs(report: dict[str, Any], name: str, mode: str, c: str) -> str:
    """The "halfmoon vs this" cell: Halfmoon at this system's precision against it."""
    s = report["setup"]["systems"][name]
    if name.startswith("halfmoon"):
        return ""
    if mode == "fixed" and s.get("prefix_cache") == "none":
        return "n/a: no prefix cache, and the prompts are cache-friendly"
    precision = s.get("precision") or report["setup"]["precisions"][0]  # external: the first
    layouts = halfmoon_at(report, precision)
    if not layouts:
        return f"n/a: no Halfmoon run at {precision}"
    # Halfmoon's best layout at this level (by output tokens/s), named when there are two.
    best = max(layouts, key=lambda n: report["systems"][n][mode][c]["output_tok_s"])
    cell = _ratio(report["systems"][best][mode][c], report["systems"][name][mode][c])
    return f"{best}: {cell}" if len(layouts) > 1 else cell


def _header(compare: bool) -> str:
    return (
        f"{'system':26}{'out tok/s':>10}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'e2e p50':>9}{'cached':>7}"
        f"{'fail':>5}{'!=T':>5}" + ("  halfmoon vs this" if compare else "")
    )


def _row(name: str, r: dict[str, Any], s: dict[str, Any], vs: str) -> str:
    return (
        f"{name:26}{r['output_tok_s']:>10.1f}{r['ttft_p50_ms']:>10.0f}"
        f"{r['ttft_p99_ms']:>10.0f}{r['itl_p50_ms']:>9.0f}{r['itl_p99_ms']:>9.0f}"
        f"{r['e2e_p50_ms']:>9.0f}{_cached(r, s):>7}{r['failures']:>5}"
        f"{r.get('wrong_length', 0):>5}" + (f"  {vs}" if vs else "")
    )


def render(report: dict[str, Any]) -> str:
    """The banner, then one table per prompt mode and concurrency level. "!=T" counts the
    answers whose usage says they were not exactly T tokens long (which would skew tok/s)."""
    w, setup = report["workload"], report["setup"]
    rows = [
        banner(setup),
        "",
        f"serving benchmark: {w['prompt_tokens']}+{w['output_tokens']} tokens, "
        f"{w['rounds']} rounds after {w['warmup']} warm-up, "
        f"precision {', '.join(setup['precisions'])}",
    ]
    names = list(report["systems"])
    compare = any(n.startswith("halfmoon") for n in names) and len(names) > 1
    for name, s in setup["systems"].items():  # a system that failed is said, not left out
        if s.get("error"):
            last = s["error"].strip().splitlines()[-1:] or ["(no output)"]
            rows.append(f"  {name} did not run: {last[0][:200]}")
    for mode in w["prompts"]:
        for c in report["concurrency"]:
            rows += ["", f"prompts {w['prompts_labels'][mode]}, concurrency {c}", _header(compare)]
            for name in names:
                r = report["systems"][name][mode][str(c)]
                s = setup["systems"][name]
                rows.append(_row(name, r, s, _vs(report, name, mode, str(c)) if compare else ""))
    return "\n".join(rows)
