"""The context bench's pieces: its text, its perplexity (against transformers' loss) and
its decode timing, on a random Llama (the bench itself runs the real model at 32k)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from services.tools.bench import context
from tests.factories import tiny_llama


def test_perplexity_is_transformers_loss_over_the_last_tokens():
    lm = tiny_llama(max_len=512)
    ids = [(7 * i + 3) % 300 for i in range(300)]
    engine = context.engine_for(lm, len(ids), chunk=64)
    got = context.perplexity(engine, ids, scored=100)
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    assert got == pytest.approx(math.exp(float(nll[-100:].mean())), rel=1e-4)


def test_decode_timing_runs_one_stream_after_a_cached_prompt():
    lm = tiny_llama(max_len=512)
    ids = list(range(1, 200))
    engine = context.engine_for(lm, len(ids) + 16, chunk=64)
    context.perplexity(engine, ids, scored=10)  # leaves the text in the prefix cache
    assert context.decode_at(engine, ids, steps=4) > 0
    assert not engine.has_work()


def test_decode_timing_leaves_out_an_uncached_prompts_prefill(monkeypatch):
    """With nothing cached (bench long's decode part), the prompt's chunks run first and
    untimed: the timed steps are the decode steps alone."""
    lm = tiny_llama(max_len=512)
    ids = list(range(1, 200))  # 4 chunks of 64
    engine = context.engine_for(lm, len(ids) + 16, chunk=64)
    timed = []
    clock = iter(range(10**6))
    fake = SimpleNamespace(perf_counter=lambda: timed.append(1) or next(clock))
    monkeypatch.setattr(context, "time", fake)  # the bench's clock only, not the engine's
    assert context.decode_at(engine, ids, steps=4) == 1.0  # every timed step one tick
    assert len(timed) == 2 * 4  # two clock reads for each of the 4 decode steps
    assert not engine.has_work()


class _Words:
    """A tokenizer stand-in: one id per word (the bench needs only input_ids)."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [len(w) for w in text.split()]}


def test_the_text_is_cut_to_length_or_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a bb ccc " * 10)
    assert context.long_text(str(f), _Words(), 5) == [1, 2, 3, 1, 2]
    with pytest.raises(ValueError, match="holds 30 tokens, not 31"):
        context.long_text(str(f), _Words(), 31)
    assert len(context.long_text("", _Words(), 40_000)) == 40_000  # the stdlib suffices
