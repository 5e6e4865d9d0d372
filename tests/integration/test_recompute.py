"""Recompute instead of a KV transfer (real model, fp32): a request continued from its
prompt + tokens so far, on an engine that never saw it, streams exactly what it would
have streamed, text included, with nothing repeated."""

from __future__ import annotations

import pytest
import torch

from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model

pytestmark = pytest.mark.model
PROMPTS = ["Write a haiku about the moon.", "Summarize the history of Rome. " * 12]


@pytest.fixture(scope="module")
def lm(model_dir):
    torch.manual_seed(0)
    return load_model(model_dir, "float32", threads=2)


def run(engine: LLMEngine, rid: str) -> list[tuple[list[int], str]]:
    steps = []
    while engine.has_work():
        steps += [(o.new_token_ids, o.text) for o in engine.step() if o.request_id == rid]
    return steps


def test_recompute_continues_the_same_stream(lm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for n, (text, split) in enumerate(zip(PROMPTS, (1, 7))):
        ids = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )["input_ids"]
        whole = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=128))
        whole.add_request(f"w{n}", ids, params)
        ref = run(whole, f"w{n}")
        done_tokens = [t for toks, _ in ref[:split] for t in toks]
        done_text = "".join(t for _, t in ref[:split])

        other = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=128))
        other.add_recompute(f"w{n}", ids, done_tokens, params, done_text)
        rest = run(other, f"w{n}")
        assert [t for toks, _ in rest for t in toks] == [t for toks, _ in ref[split:] for t in toks]
        assert done_text + "".join(t for _, t in rest) == "".join(t for _, t in ref)
        assert len(rest) == 16 - split
        assert other.blocks.num_free_blocks == other.blocks.num_blocks  # all given back
