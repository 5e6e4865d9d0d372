"""`halfmoon bench serve` without its servers: the defaults, that fresh prompts never repeat
(sent for real, to a recording OpenAI-style endpoint), what each system is started with
(command, environment, CPUs, threads), the pinning of a whole process tree for real, and
the banner and table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from services.tools.bench.placement import Placement, format_cpus, parse_cpus, placements
from services.tools.bench.serve import cli as serve_cli
from services.tools.bench.serve import report as serve_report
from services.tools.bench.serve import systems as serve_systems
from services.tools.bench.serve import workload as serve_workload
from services.tools.bench.servers import (
    HalfmoonServer,
    LlamaCppServer,
    Server,
    TransformersServer,
    torch_launch,
)
from shared.engine import cpu

BLOCK = 16  # the gateway's default KV block size (services/gateway/args.py)


def args_for(*argv: str) -> Any:
    a = serve_cli.parser().parse_args(list(argv))
    a.prompt_seed = a.prompt_seed or "4f6e2428"  # as long as a real one
    return a


@pytest.fixture(scope="module")
def maker(model_dir: Path) -> serve_workload.PromptMaker:
    return serve_workload.PromptMaker(model_dir, 64)


# --- defaults ---------------------------------------------------------------------------


def test_defaults_are_fair():
    a = serve_cli.parser().parse_args([])
    assert a.prompts == "fresh"  # not the cache-friendly fixed prompts
    assert a.cpus == ""  # all cores this process may use
    assert a.dtype == "auto"
    assert (a.concurrency, a.rounds, a.warmup) == (16, 3, 1)
    assert a.systems == "halfmoon,transformers-cb,transformers"
    assert a.speculation == "off"  # drafts only when asked, for every system alike
    assert serve_workload.PROMPT_LABELS == {
        "fresh": "fresh",
        "fixed": "cache-friendly",
        "grounded": "input-grounded",
    }


# --- prompts ----------------------------------------------------------------------------


def test_grounded_prompts_carry_their_source_and_share_no_first_block(
    maker: serve_workload.PromptMaker,
):
    tags = [serve_workload.prompt_tag("grounded", "s", 4, rnd) for rnd in range(2)]
    rounds = [maker.round(tag, 4, "grounded") for tag in tags]
    assert tags[0] != serve_workload.prompt_tag("fresh", "s", 4, 0)  # never fresh's cache
    firsts = {tuple(maker.ids(m)[:16]) for r in rounds for m in r}
    assert len(firsts) == 8  # each its own lead: no prefix cache serves any of them
    # Each asks to repeat or to edit a standard-library function whose source it carries.
    for m in (m for r in rounds for m in r):
        assert "def " in m[-1]["content"]
        assert m[-1]["content"].startswith(("Repeat this function", "Rename `"))
    assert len({m[-1]["content"] for r in rounds for m in r}) > 1  # drawn, not one task
    assert maker.longest("grounded") >= max(len(maker.ids(m)) for r in rounds for m in r)
    assert maker.longest("grounded") > maker.longest("fresh") == maker.tokens


def test_prompts_reach_the_length_and_fixed_ones_repeat(maker: serve_workload.PromptMaker):
    fixed = [maker.round(serve_workload.prompt_tag("fixed", "s", 4, rnd), 4) for rnd in range(3)]
    assert fixed[0] == fixed[1] == fixed[2]  # the warm-up (round 0) too
    assert all(len(maker.ids(m)) >= 64 for m in fixed[0])
    fresh = [maker.round(serve_workload.prompt_tag("fresh", "s", 4, rnd), 4) for rnd in range(2)]
    assert fresh[0] != fresh[1]
    assert (
        maker.round(serve_workload.prompt_tag("fresh", "other", 4, 0), 4) != fresh[0]
    )  # seed matters


def _server(seen: list[dict[str, Any]], out_tokens: int) -> web.Application:
    """An OpenAI-style endpoint that records each request and streams `out_tokens` chunks."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def chat(req: web.Request) -> web.StreamResponse:
        seen.append(await req.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for _ in range(out_tokens):
            chunk = {"choices": [{"delta": {"content": "x"}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"usage": {"completion_tokens": out_tokens, "prompt_tokens": 64}, "choices": []}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def _sent(
    maker: serve_workload.PromptMaker, args: Any, levels: list[int]
) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    runner = web.AppRunner(_server(seen, args.output_tokens))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        for c in levels:  # as measure() runs them, one level after another on one server
            summary = await serve_workload.run_rounds(
                f"http://127.0.0.1:{port}", maker, args, c, "ignore_eos"
            )
            assert summary["failures"] == 0 and summary["requests"] == c * args.rounds
    finally:
        await runner.cleanup()
    return seen


async def test_fresh_prompts_never_repeat_nor_share_a_block(maker: serve_workload.PromptMaker):
    args = args_for(
        "--prompt-tokens", "64", "--output-tokens", "2", "--rounds", "2", "--warmup", "1"
    )
    sent = await _sent(maker, args, [1, 4])
    assert len(sent) == (1 + 4) * 3  # the warm-up round is sent too
    texts = [json.dumps(b["messages"]) for b in sent]
    assert len(set(texts)) == len(texts)  # no prompt repeats, warm-up and levels included
    first_blocks = [tuple(maker.ids(b["messages"])[:BLOCK]) for b in sent]
    assert len(set(first_blocks)) == len(first_blocks)  # no prefix cache can serve any
    assert all(b["ignore_eos"] and b["max_tokens"] == 2 and b["temperature"] == 0 for b in sent)


async def test_fixed_prompts_repeat_every_round_warmup_included(maker: serve_workload.PromptMaker):
    args = args_for(
        "--prompts",
        "fixed",
        "--prompt-tokens",
        "64",
        "--output-tokens",
        "2",
        "--rounds",
        "2",
        "--warmup",
        "1",
    )
    sent = await _sent(maker, args, [4])
    rounds = [[json.dumps(b["messages"]) for b in sent[i : i + 4]] for i in range(0, 12, 4)]
    assert sorted(rounds[0]) == sorted(rounds[1]) == sorted(rounds[2])
    assert len(set(rounds[0])) == 4


# --- where each system runs -------------------------------------------------------------


def test_cpu_sets_parse_and_print():
    assert format_cpus((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert parse_cpus("") == tuple(sorted(os.sched_getaffinity(0)))
    first = min(os.sched_getaffinity(0))
    assert parse_cpus(f"{first}") == (first,)
    with pytest.raises(ValueError):
        parse_cpus("4096")  # not a CPU this process may use
    with pytest.raises(ValueError):
        parse_cpus("3-1")


@pytest.mark.parametrize(
    "extra, cpus, halfmoon, transformers",
    [
        ([], (0, 1), (2, 1), 2),  # 1 prefill + 1 decode: one thread each; transformers both
        ([], (0, 1, 2, 3), (2, 2), 4),
        ([], (0,), (2, 1), 2),  # never 0 threads: oversubscribed alike
        (["--colocated", "1"], (0, 1), (1, 2), 2),
        (["--prefill", "2", "--decode", "1"], (0, 1, 2, 3, 4, 5), (3, 2), 6),
        (["--threads", "3"], (0, 1), (2, 3), 6),  # an explicit --threads holds, on both sides
    ],
)
def test_both_sides_get_the_same_cores_and_threads_in_total(extra, cpus, halfmoon, transformers):
    hm, tf = placements(cpus, extra)
    assert (hm.processes, hm.threads) == halfmoon
    assert (tf.processes, tf.threads) == (1, transformers)
    assert hm.cpus == tf.cpus == cpus
    assert hm.total_threads == tf.total_threads


def test_commands_and_environments(model_dir: Path):
    args = args_for(
        "--systems", "halfmoon,transformers-cb,transformers", "--halfmoon-args", "--colocated 1"
    )
    servers = serve_systems.servers_for(args.systems.split(","), model_dir, args)
    try:
        hm, cb, plain = servers
        dtype = cpu.resolve_dtype("auto")[0]
        ncpu = len(os.sched_getaffinity(0))
        assert isinstance(hm, HalfmoonServer) and isinstance(cb, TransformersServer)
        cmd = hm.command()
        assert cmd[cmd.index("--dtype") + 1] == dtype  # concrete, never "auto"
        assert cmd[cmd.index("--threads") + 1] == str(ncpu)  # one colocated engine, all cores
        assert cmd[-2:] == ["--colocated", "1"]
        env = hm.launch_env()
        assert env["OMP_NUM_THREADS"] == str(ncpu) and env["TOKENIZERS_PARALLELISM"] == "false"
        for t in (cb, plain):
            c = t.command()
            assert c[c.index("serve") - 2] == str(ncpu)  # torch threads, set at launch
            assert c[c.index("--dtype") + 1] == dtype
            assert c[c.index("--device") + 1] == "cpu"
            assert t.launch_env()["OMP_NUM_THREADS"] == str(ncpu)
            assert t.placement.cpus == hm.placement.cpus
        assert "--continuous-batching" in cb.command()
        assert "--continuous-batching" not in plain.command()
        assert cb.name == "transformers-serve-cb" and plain.name == "transformers-serve"
        assert plain.prefix_cache == "none" and cb.prefix_cache != "none"
    finally:
        for s in servers:
            s.stop()


def test_speculation_both_runs_each_system_without_and_with_its_drafter(model_dir: Path):
    args = args_for(
        "--systems", "halfmoon-colocated,transformers-cb", "--speculation", "both",
        "--spec-tokens", "6",
    )  # fmt: skip
    servers = serve_systems.servers_for(args.systems.split(","), model_dir, args)
    try:
        names = {s.name: s for s in servers}
        # transformers serve has no drafter: it runs once, without.
        assert set(names) == {
            "halfmoon-colocated",
            "halfmoon-colocated-spec",
            "transformers-serve-cb",
        }
        spec = names["halfmoon-colocated-spec"].command()
        assert spec[spec.index("--num-speculative-tokens") + 1] == "6"
        assert "--num-speculative-tokens" not in names["halfmoon-colocated"].command()
    finally:
        for s in servers:
            s.stop()
    # llama-server gets its own n-gram drafter's flag after the bench's own.
    where = Placement((0,), 1, 1)
    llama = LlamaCppServer(
        model_dir, Path("llama-server"), Path("m.gguf"), "f32", where, 384,
        ["--spec-type", args.llama_cpp_spec],
    )  # fmt: skip
    assert llama.command()[-2:] == ["--spec-type", "ngram-simple"]


def test_the_thread_budget_reaches_torch(model_dir: Path, tmp_path: Path):
    """transformers serve's launch: its torch runs the placement's thread count, even one
    above the cores (OMP_NUM_THREADS alone is capped there)."""
    ncpu = len(os.sched_getaffinity(0))
    place = Placement(tuple(sorted(os.sched_getaffinity(0))), 1, ncpu + 1)
    server = TransformersServer(model_dir, "float32", place, continuous_batching=False)
    try:
        exe = Path(sys.executable).with_name("transformers")
        assert server.command()[:5] == torch_launch(exe, ncpu + 1)
        assert server.command()[5] == "serve"
        script = tmp_path / "probe"
        script.write_text("import sys, torch; print(torch.get_num_threads(), sys.argv[1:])\n")
        out = subprocess.run(
            [*torch_launch(script, ncpu + 1), "serve", "x"],
            env=server.launch_env(),
            preexec_fn=server._preexec,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert out.stdout.split(None, 1) == [str(ncpu + 1), "['serve', 'x']\n"]
    finally:
        server.stop()


PROBE = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class Probe(Server):
    """A server process with a child of its own: what start() pins, observe() reads back."""

    name = "probe"

    def command(self) -> list[str]:
        return [sys.executable, "-c", PROBE, str(self.port)]


def test_the_whole_process_tree_is_pinned_and_stopped(model_dir: Path):
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin to a strict subset")
    probe = Probe(model_dir, "float32", Placement(cpus[:1], 1, 1))
    try:
        probe.start(timeout_s=60)
        deadline = time.monotonic() + 10
        while len(seen := probe.observe()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(seen) == 2  # the server and its child
        assert {p["cpus"] for p in seen} == {str(cpus[0])}
        assert all(p["os_threads"] >= 1 for p in seen)
        pids = [p["pid"] for p in seen]
    finally:
        probe.stop()
    # stop() returns once the whole tree has exited: the child too, not just the server
    assert not [
        pid
        for pid in pids
        if Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    ]


# --- banner and table -------------------------------------------------------------------


ROW = {
    "output_tok_s": 100.0,
    "ttft_p50_ms": 500.0,
    "ttft_p99_ms": 900.0,
    "itl_p50_ms": 30.0,
    "itl_p99_ms": 60.0,
    "e2e_p50_ms": 2000.0,
    "failures": 0,
    "wrong_length": 0,
    "prompt_tokens": 1000,
    "cached_tokens": 0,
}


def _report(args: Any, servers: list[Server], observed: dict[str, list[dict]]) -> dict:
    setup = serve_systems.setup_for(args, servers)
    for name, seen in observed.items():
        setup["systems"][name]["observed"] = seen
    modes = serve_workload.prompt_modes(args.prompts)

    def row(name: str) -> dict[str, Any]:
        hm = name.startswith("halfmoon")
        return dict(ROW, output_tok_s=200.0 if hm else 100.0, cached_tokens=900 if hm else 0)

    systems = {s.name: {m: {"4": row(s.name)} for m in modes} for s in servers}
    return {
        "workload": {
            "prompt_tokens": 256,
            "output_tokens": 64,
            "rounds": 1,
            "warmup": 1,
            "prompts": modes,
            "prompts_labels": {m: serve_workload.PROMPT_LABELS[m] for m in modes},
        },
        "concurrency": [4],
        "setup": setup,
        "systems": systems,
    }


def test_banner_says_what_ran_where(model_dir: Path):
    args = args_for("--systems", "halfmoon,transformers-cb")
    servers = serve_systems.servers_for(["halfmoon", "transformers-cb"], model_dir, args)
    try:
        cpus = format_cpus(sorted(os.sched_getaffinity(0)))
        hm_threads = max(1, len(os.sched_getaffinity(0)) // 2)
        seen = {
            "halfmoon": [
                {"pid": 1, "name": "services.cli", "nice": 0, "cpus": cpus, "os_threads": 3},
                {"pid": 2, "name": "services.decode", "nice": 10, "cpus": "0-63", "os_threads": 9},
            ]
        }
        report = _report(args, servers, seen)
        text = serve_report.banner(report["setup"])
        assert f"cpus     {cpus}" in text and "pinned" in text
        assert cpu.resolve_dtype("auto")[0] in text
        assert "prompts  fresh" in text and "seed 4f6e2428" in text
        assert f"2 engines x {hm_threads} thread" in text
        assert f"OMP_NUM_THREADS={hm_threads}" in text
        assert f"transformers-serve-cb    1 process x {2 * hm_threads} thread" in text
        assert "NOT all pinned: services.decode on 0-63" in text  # read back, not assumed
        setup = json.loads(json.dumps(report["setup"]))  # and all of it goes into the JSON
        assert setup["prompts_labels"] == {"fresh": "fresh"} and setup["cpus"] == cpus
        assert (
            setup["systems"]["transformers-serve-cb"]["placement"]["total_threads"]
            == 2 * hm_threads
        )
    finally:
        for s in servers:
            s.stop()


def test_table_compares_only_where_it_applies(model_dir: Path):
    args = args_for("--prompts", "fixed")
    servers = serve_systems.servers_for(
        ["halfmoon", "transformers-cb", "transformers"], model_dir, args
    )
    try:
        text = serve_report.render(_report(args, servers, {}))
        assert "prompts cache-friendly" in text and "fixed (cache-friendly)" in text
        rows = {line.split()[0]: line for line in text.splitlines() if line[:1].isalpha()}
        assert "2.00x tok/s" in rows["transformers-serve-cb"]
        assert "n/a: no prefix cache" in rows["transformers-serve"]
        assert "90%" in rows["halfmoon"]  # Halfmoon reports cached tokens; transformers not
        assert " - " in rows["transformers-serve"]
        alone = serve_report.render(_report(args, servers[:1], {}))
        assert "vs this" not in alone  # no reference column without a second system
    finally:
        for s in servers:
            s.stop()


def test_the_colocated_row_runs_one_engine_on_every_thread_and_the_best_layout_compares(
    model_dir: Path,
):
    args = args_for("--systems", "halfmoon,halfmoon-colocated,transformers-cb")
    servers = serve_systems.servers_for(
        ["halfmoon", "halfmoon-colocated", "transformers-cb"], model_dir, args
    )
    try:
        disagg, colocated, _ = servers
        assert colocated.name == "halfmoon-colocated" and "--colocated" in colocated.command()
        assert "--colocated" not in disagg.command()
        assert colocated.placement.processes == 1
        assert colocated.placement.total_threads == disagg.placement.total_threads
        assert colocated.placement.cpus == disagg.placement.cpus
        report = _report(args, servers, {})
        report["systems"]["halfmoon-colocated"]["fresh"]["4"]["output_tok_s"] = 300.0
        text = serve_report.render(report)
        rows = {line.split()[0]: line for line in text.splitlines() if line[:1].isalpha()}
        # Against transformers, Halfmoon's better layout at that level: colocated, 300 / 100.
        assert "halfmoon-colocated: 3.00x tok/s" in rows["transformers-serve-cb"]
    finally:
        for s in servers:
            s.stop()
