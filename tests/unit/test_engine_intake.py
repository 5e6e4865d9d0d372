"""The engine refuses, at intake, a request no step could run: a token id outside the
vocabulary would fail the whole batch's step (IndexError in the embedding), taking every
request that shares it down too. Found by sending such a job straight onto the bus."""

from __future__ import annotations

import pytest

from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from tests.factories import tiny_llama


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(tiny_llama(vocab=300), EngineConfig(block_size=16, kv_cache_bytes=1 << 20))


@pytest.mark.parametrize("bad", [300, 10**9, -1])
def test_a_token_id_outside_the_vocabulary_is_refused_and_the_batch_runs(engine, bad):
    params = SamplingParams(max_tokens=2, temperature=0)
    good = f"good{bad}"
    engine.add_request(good, [1, 2, 3], params)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\)"):
        engine.add_request("bad", [1, bad, 3], params)
    with pytest.raises(ValueError, match="token ids"):  # a continuation's output too
        engine.add_recompute("bad2", [1, 2], [bad], params)
    with pytest.raises(ValueError, match="token ids"):  # and a logit_bias key (indexes logits)
        engine.add_request("bad3", [1, 2], SamplingParams(max_tokens=2, logit_bias=((bad, 5.0),)))
    finished = []
    while not finished:  # two tokens: a few steps
        finished += [o for o in engine.step() if o.finish_reason is not None]
    assert [(o.request_id, o.error, o.num_output_tokens) for o in finished] == [(good, None, 2)]
