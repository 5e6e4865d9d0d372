"""llama.cpp in `halfmoon bench serve`: the build's configuration (nothing fetched), the
cache folder, the command line the bench runs, precisions paired across systems, the
table's comparison at the same precision, and, where a build and its GGUF are in the
cache, a real llama-server answering the bench's requests with exactly T tokens each.
The build itself never runs here (`halfmoon bench build-llama-cpp` takes minutes)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from services.tools.bench import llama_cpp
from services.tools.bench.placement import Placement, placements
from services.tools.bench.serve import report as serve_report
from services.tools.bench.serve import systems as serve_systems
from services.tools.bench.serve import workload as serve_workload
from services.tools.bench.servers import HalfmoonServer, LlamaCppServer
from tests.unit.test_serve_bench import ROW, args_for


def test_the_build_fetches_nothing_and_builds_only_the_server(tmp_path: Path):
    args = llama_cpp.cmake_args(tmp_path / "src", tmp_path / "build", native=True)
    flags = dict(a.removeprefix("-D").split("=", 1) for a in args if a.startswith("-D"))
    assert flags["LLAMA_BUILD_UI"] == flags["LLAMA_USE_PREBUILT_UI"] == "OFF"  # no npm, no fetch
    assert flags["LLAMA_OPENSSL"] == "OFF" and flags["LLAMA_BUILD_SERVER"] == "ON"
    assert flags["LLAMA_BUILD_TESTS"] == flags["LLAMA_BUILD_EXAMPLES"] == "OFF"
    assert flags["GGML_NATIVE"] == "ON" and flags["CMAKE_BUILD_TYPE"] == "Release"
    assert flags["CMAKE_CXX_FLAGS"] == flags["CMAKE_C_FLAGS"] == "-mno-amx-int8"
    off = llama_cpp.cmake_args(tmp_path / "src", tmp_path / "build", native=False)
    assert "-DGGML_NATIVE=OFF" in off and not any("amx" in a for a in off)


def test_the_cache_is_per_pinned_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert llama_cpp.sdist_version("llama-cpp-python==0.3.36") == "0.3.36"
    with pytest.raises(ValueError, match="pin"):
        llama_cpp.sdist_version("llama-cpp-python>=0.3")
    monkeypatch.setenv("HALFMOON_HOME", str(tmp_path / "hm"))
    monkeypatch.delenv("HALFMOON_LLAMA_CPP_HOME", raising=False)
    root = llama_cpp.home()
    assert root == tmp_path / "hm" / "llama.cpp" / "llama-cpp-python-0.3.36"
    monkeypatch.setenv("HALFMOON_LLAMA_CPP_HOME", str(tmp_path / "elsewhere"))
    assert llama_cpp.home().parent == tmp_path / "elsewhere"
    # A binary without the finished-build marker is a half-done build: not used.
    exe = llama_cpp.server_binary(root)
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert llama_cpp.built_server(root) is None
    llama_cpp.build_info_path(root).write_text("{}")
    assert llama_cpp.built_server(root) == exe


def test_the_command_line_matches_halfmoons_cores_and_threads(model_dir: Path, tmp_path: Path):
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    hm, single = placements(cpus, [])
    gguf = tmp_path / "m.q8_0.gguf"
    server = LlamaCppServer(model_dir, tmp_path / "llama-server", gguf, "q8_0", single, 400)
    try:
        server.at_concurrency(16)
        cmd = server.command()
        opt = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("--")}
        assert cmd[0] == str(tmp_path / "llama-server") and opt["--model"] == str(gguf)
        assert opt["--threads"] == opt["--threads-batch"] == str(hm.total_threads)
        assert opt["--parallel"] == "16" and opt["--ctx-size"] == str(16 * 400)
        assert opt["--host"] == "127.0.0.1" and opt["--port"] == str(server.port)
        assert {"--cont-batching", "--cache-prompt", "--jinja", "--no-webui"} <= set(cmd)
        assert single.cpus == hm.cpus and single.total_threads == hm.total_threads
        assert server.restarts_per_level and server.request_extra == {"cache_prompt": True}
        assert server.eos_style == "ignore_eos"
        body = serve_workload.body(
            "m", [{"role": "user", "content": "x"}], 64, "ignore_eos", {"a": 1}
        )
        assert body["ignore_eos"] is True and body["a"] == 1 and body["max_tokens"] == 64
    finally:
        server.stop()
    # Every slot holds a whole request: the prompt, every output token, the template's overshoot.
    assert llama_cpp.slot_tokens(256, 64) >= 256 + 64 + 64


def test_precisions_pair_and_skip_with_a_reason(model_dir: Path):
    args = args_for("--systems", "halfmoon,transformers-cb", "--precisions", "fp32,int8")
    servers = serve_systems.servers_for(["halfmoon", "transformers-cb"], model_dir, args)
    try:
        names = {s.name: s for s in servers}
        assert set(names) == {"halfmoon-fp32", "halfmoon-int8", "transformers-serve-cb-fp32"}
        int8 = names["halfmoon-int8"]
        assert isinstance(int8, HalfmoonServer)
        cmd = int8.command()
        assert cmd[cmd.index("--quantization") + 1] == "int8"
        assert cmd[cmd.index("--dtype") + 1] == "float32"
        assert "--quantization" not in names["halfmoon-fp32"].command()
        setup = serve_systems.setup_for(args, servers)
        assert setup["skipped"] == ["transformers-cb at int8: transformers serve has no int8 here"]
        assert "precision fp32, int8" in serve_report.banner(setup)
    finally:
        for s in servers:
            s.stop()
    with pytest.raises(SystemExit):
        serve_systems.precisions_for(args_for("--precisions", "fp16"))
    assert serve_workload.prompt_modes("fresh,fixed") == ["fresh", "fixed"]
    with pytest.raises(SystemExit):
        serve_workload.prompt_modes("warm")


def _llama_setup(precision: str) -> dict[str, Any]:
    return {"precision": precision, "prefix_cache": "slots", "reports_cached_tokens": True}


def test_the_table_compares_at_the_same_precision():
    """llama.cpp's Q8_0 against Halfmoon's int8, its f32 against fp32, q4_1 against none."""
    setup = {
        "cpus": "0-1",
        "cpu_count": 2,
        "machine_cpus": 2,
        "cpu_model": "cpu",
        "precisions": ["fp32", "int8", "q4_1"],
        "precisions_why": "set with --precisions",
        "skipped": [],
        "prompts": ["fresh", "fixed"],
        "prompt_seed": "s",
        "client": {"pid": 1, "cpus": "0-1"},
        "systems": {
            "halfmoon-fp32": {"precision": "fp32", "prefix_cache": "blocks", "placement": None},
            "halfmoon-int8": {"precision": "int8", "prefix_cache": "blocks", "placement": None},
            "llama.cpp-f32": {**_llama_setup("fp32"), "placement": None},
            "llama.cpp-q8_0": {**_llama_setup("int8"), "placement": None},
            "llama.cpp-q4_1": {**_llama_setup("q4_1"), "placement": None},
        },
    }
    speed = {
        "halfmoon-fp32": 100.0,
        "halfmoon-int8": 300.0,
        "llama.cpp-f32": 50.0,
        "llama.cpp-q8_0": 100.0,
        "llama.cpp-q4_1": 10.0,
    }
    report = {
        "workload": {
            "prompt_tokens": 256,
            "output_tokens": 64,
            "rounds": 1,
            "warmup": 1,
            "prompts": ["fresh", "fixed"],
            "prompts_labels": {"fresh": "fresh", "fixed": "cache-friendly"},
        },
        "concurrency": [4],
        "setup": setup,
        "systems": {
            n: {
                m: {"4": dict(ROW, output_tok_s=v, wrong_length=3 * (n == "llama.cpp-f32"))}
                for m in ("fresh", "fixed")
            }
            for n, v in speed.items()
        },
    }
    failed = {"placement": None, "prefix_cache": "none", "error": "Traceback\nImportError: boom"}
    setup["systems"]["transformers-serve-cb-fp32"] = failed
    text = serve_report.render(report)
    assert "transformers-serve-cb-fp32 did not run: ImportError: boom" in text
    assert (
        "prompts fresh, concurrency 4" in text and "prompts cache-friendly, concurrency 4" in text
    )
    rows = [line for line in text.splitlines() if line.startswith("llama.cpp")]
    assert len(rows) == 6  # three GGUFs, two prompt modes
    f32, q8, q4 = rows[:3]
    assert "2.00x tok/s" in f32 and "3.00x tok/s" in q8  # 100/50 and 300/100
    assert "n/a: no Halfmoon run at q4_1" in q4
    assert f32.split()[9] == "3"  # the "!=T" column: answers not exactly T tokens long


def _built() -> tuple[Path, Path] | None:
    root = llama_cpp.home()
    exe = llama_cpp.built_server(root)
    gguf = llama_cpp.gguf_path(root, "SmolLM2-135M-Instruct", "q4_1")
    return (exe, gguf) if exe and gguf.is_file() else None


@pytest.mark.model
def test_a_real_llama_server_gives_exactly_t_tokens(model_dir: Path):
    """The bench's own requests against llama-server (the smallest GGUF, two slots): every
    answer streams, and its usage says exactly T tokens, end of sequence ignored."""
    found = _built()
    if found is None:
        pytest.skip("llama.cpp is not built here: `halfmoon bench build-llama-cpp` builds it")
    exe, gguf = found
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    slot = llama_cpp.slot_tokens(64, 8)
    server = LlamaCppServer(model_dir, exe, gguf, "q4_1", Placement(cpus, 1, len(cpus)), slot)
    args = args_for("--prompt-tokens", "64", "--output-tokens", "8", "--rounds", "1")
    try:
        server.at_concurrency(2)
        server.start(timeout_s=120)
        maker = serve_workload.PromptMaker(model_dir, 64)
        summary = asyncio.run(
            serve_workload.run_rounds(
                server.url, maker, args, 2, server.eos_style, "fresh", server.request_extra
            )
        )
    finally:
        server.stop()
    assert summary["failures"] == 0 and summary["requests"] == 2
    assert summary["wrong_length"] == 0 and summary["output_tok_s"] > 0
