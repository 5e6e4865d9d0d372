"""`halfmoon model import PATH`: a user's model into the models cache, once.

PATH is a GGUF file (from the llama.cpp ecosystem; quantized ones are dequantized, as the
default model's is) or a transformers folder. Either way the result is a plain
transformers folder under HALFMOON_HOME/models/NAME, with the tokenizer and chat template
the model ships, and `--model NAME` serves it. The family is checked first, so a model
the engine cannot run is refused before anything is written (architectures.py).

Serving it in int8 needs nothing here: `--quantization int8` quantizes the weights as
the engine loads them, from whatever dtype the folder holds.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from shared import model_store

log = logging.getLogger(__name__)

STORE_DTYPES = ("float32", "bfloat16")
# What a transformers folder needs to load and serve; anything else (checkpoints of
# training, READMEs, images, other formats' weights) stays behind.
_KEEP_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".tiktoken")


def import_model(path: Path, name: str = "", dtype: str = "float32", force: bool = False) -> Path:
    """The cache folder `path` was imported into (converted now unless it already was)."""
    from shared.engine import architectures  # torch: only where a model is imported

    path = Path(path).expanduser().resolve()
    gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if not gguf and not (path / "config.json").is_file():
        raise ValueError(f"{path}: neither a .gguf file nor a folder with a config.json")
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {', '.join(STORE_DTYPES)}")
    # A folder's family before anything is copied (a GGUF's is known once converted).
    family = None if gguf else architectures.check_folder(path)
    name = name or (path.stem if gguf else path.name)
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"model name {name!r}: a plain folder name, please (--name)")
    target = model_store.models_dir_created() / name
    if model_store.is_ready(target) and not force:
        log.info("%s is imported already at %s (--force converts it again)", path, target)
        return target
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=target.parent))
    try:
        if gguf:
            arch = model_store.convert_gguf(path, staging, name, dtype)
            architectures.check_folder(staging)  # the GGUF's family: refused if unsupported
        else:
            assert family is not None
            arch = family.architecture
            _copy_folder(path, staging)
        model_store.mark_complete(staging, f"imported {arch} from {path}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("imported %s (%s) into %s", path, arch, target)
    return target


def _copy_folder(src: Path, dst: Path) -> None:
    for item in src.iterdir():
        if item.is_file() and item.name.endswith(_KEEP_SUFFIXES):
            shutil.copy2(item, dst / item.name)
