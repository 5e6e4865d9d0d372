"""Loading a transformers causal LM (a family of architectures.py) and its tokenizer for the
engine."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from shared.engine import architectures, cpu
from shared.engine.hf_types import HFConfig, causal_lm
from shared.model_context import ModelContext, for_model

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    dtype: torch.dtype
    device: str
    max_model_len: int
    eos_token_ids: frozenset[int]

    @property
    def config(self) -> HFConfig:
        return causal_lm(self.model).config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)


def eos_ids(model_dir: Path, tokenizer: object, config: object) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return frozenset(ids)


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 0,
    name: str = "",
    context: ModelContext | None = None,
) -> LoadedModel:
    """`dtype` auto picks bfloat16 where the device computes it natively, else float32.
    `context` (default: the model's own) sets the context length and RoPE scaling."""
    dtype, why = cpu.resolve_dtype(dtype, device)
    if device == "cpu" and dtype == "bfloat16" and not cpu.detect().native_bf16:
        log.warning(
            "bfloat16 on a CPU without native bf16 (%s): emulated, several times "
            "slower than float32",
            cpu.detect().level,
        )
    if threads > 0:
        # Several engine processes share few cores: each gets its own thread budget.
        torch.set_num_threads(threads)
    path = Path(model_dir)
    architectures.check_folder(path)  # before any weights: one clear line if unsupported
    hf_logging.disable_progress_bar()  # one line per load in the logs, not a progress bar
    t0 = time.perf_counter()
    context = context or for_model(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True, **context.overrides)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=DTYPES[dtype], local_files_only=True
    )
    # transformers' typing of .to wraps it past recognition: the plain Module signature.
    cast(torch.nn.Module, model).to(device).eval()
    cfg = model.config
    log.info(
        "loaded %s in %.1fs: %s on %s (%s); CPU %s, torch dispatch %s; context %d tokens%s",
        path,
        time.perf_counter() - t0,
        dtype,
        device,
        why,
        cpu.detect().level,
        torch.backends.cpu.get_cpu_capability(),
        context.max_model_len,
        _stretch(context),
    )
    return LoadedModel(
        name=name or path.name,
        model=model,
        tokenizer=tok,
        dtype=DTYPES[dtype],
        device=device,
        max_model_len=context.max_model_len,
        eos_token_ids=eos_ids(path, tok, cfg),
    )


def _stretch(context: ModelContext) -> str:
    rope = context.overrides.get("rope_parameters")
    if not rope:
        return ""
    return f" (RoPE {rope['rope_type']} from {context.trained_len} trained positions)"
