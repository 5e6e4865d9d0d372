"""`halfmoon model import`: a quantized GGUF (written here, with the gguf package) and a
transformers folder into the models cache, once; the engine runs what it wrote; what it
cannot run is refused in one line before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from shared.engine.runner import load_model
from shared.model_import import import_model
from tests.factories import tiny_family
from tests.gguf_files import write_qwen2_gguf

pytestmark = pytest.mark.model  # the GGUF borrows the default model's tokenizer


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.Q8_0.gguf"
    return path, write_qwen2_gguf(path, model_dir)


def cli(*args: str, home) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HALFMOON_HOME": str(home)}
    cmd = [sys.executable, "-m", "services.cli", "model", "import", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_a_quantized_gguf_becomes_a_folder_the_engine_serves(gguf_file, home, model_dir):
    path, expected = gguf_file
    done = cli(str(path), home=home)
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip().splitlines()[-1]
    assert name == "tiny-qwen2.Q8_0"
    folder = home / "models" / name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    weights = load_file(str(folder / "model.safetensors"))
    for key, want in expected.items():  # Q8_0 dequantized exactly as gguf's reader does
        assert torch.equal(weights[key], torch.from_numpy(want).reshape(weights[key].shape)), key
    lm = load_model(folder, "float32")
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )["input_ids"]
    want = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert lm.tokenizer.decode(ids) == want and "<|im_start|>assistant" in want


def test_importing_again_keeps_the_first_conversion_unless_forced(gguf_file, home):
    path, _ = gguf_file
    first = import_model(path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert import_model(path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    again = import_model(path, force=True, dtype="bfloat16")
    assert load_file(str(again / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16


def test_a_transformers_folder_is_copied_in(tmp_path, home, model_dir):
    src = tmp_path / "my-qwen3"
    tiny_family("qwen3").model.save_pretrained(src)
    for f in [*model_dir.glob("tokenizer*"), *model_dir.glob("chat_template*")]:
        shutil.copy(f, src / f.name)
    (src / "README.md").write_text("not needed to serve")
    target = import_model(src)
    assert target == home / "models" / "my-qwen3"
    assert (target / "model.safetensors").exists() and not (target / "README.md").exists()
    lm = load_model(target, "float32")
    assert type(lm.model).__name__ == "Qwen3ForCausalLM"
    assert lm.tokenizer.chat_template


def test_an_unsupported_model_is_refused_in_one_line_and_nothing_written(tmp_path, home):
    src = tmp_path / "gemma"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"]}))
    done = cli(str(src), home=home)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unsupported model architecture GemmaForCausalLM" in lines[0]
    assert not (home / "models" / "gemma").exists()
    missing = cli(str(tmp_path / "nothing-here"), home=home)
    assert missing.returncode == 1 and "neither a .gguf file nor a folder" in missing.stderr
