"""The served context on the real model: loaded stretched with --rope-scaling yarn:4, the
engine admits a prompt past the 8,192 trained positions and decodes as transformers does
under the same config; and `halfmoon up` refuses a context the model cannot serve before
it starts anything, in one line that names the setting and the way out."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model
from shared.model_context import for_model

pytestmark = pytest.mark.model


def test_stretched_the_model_admits_past_its_trained_context_and_matches_transformers(
    model_dir,
):
    lm = load_model(model_dir, "float32", threads=2, context=for_model(model_dir, 0, "yarn:4"))
    assert lm.max_model_len == 32768
    assert lm.config.rope_parameters["rope_type"] == "yarn"
    # A pool that holds 9,000 tokens (fp32: 45 KiB a token): a prompt past 8,192 fits.
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=416 << 20))
    engine.check_fits([5] * 9000, SamplingParams(max_tokens=4))  # raises if refused
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.check_fits([5] * 32768, SamplingParams(max_tokens=1))
    # The stretched rotary table runs as transformers runs it (YaRN changes every position).
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = lm.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    engine.add_request("r", ids[0].tolist(), SamplingParams(temperature=0, max_tokens=12))
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert out == ref.tolist()


def up(model_dir: Path, home: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:  # a port free now: the port check is not what is tested
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--no-console"]
        + ["--metrics-base-port", "0", "--model", str(model_dir), *flags],
        env={"HALFMOON_HOME": str(home), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,  # a failure bound: it exits before loading anything
    )


def test_a_context_past_the_trained_one_without_rope_scaling_is_one_line(model_dir, tmp_path):
    done = up(model_dir, tmp_path / "home", "--max-model-len", "32768")
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "max_model_len 32768 exceeds the 8192 positions" in lines[0]
    assert "rope_scaling (e.g. yarn:4)" in lines[0]
    assert not (tmp_path / "home" / "nats").exists()  # nothing started


def test_an_unknown_rope_scaling_is_refused_naming_the_setting(model_dir, tmp_path):
    done = up(model_dir, tmp_path / "home", "--rope-scaling", "ntk:4")
    assert done.returncode == 2, done.stderr
    assert "rope_scaling" in done.stderr and "known types: linear, yarn" in done.stderr
    assert "Traceback" not in done.stderr
