"""A prompt past the model's trained 8,192 positions through the whole stack, stretched
with `halfmoon up --rope-scaling yarn:4 --max-model-len 9216`: the gateway admits it, the
engines run it (a streamed handoff of its 500-odd blocks included), and the answer is the
engine's own greedy answer under the same stretch, token for token (the engine matches
transformers there: tests/integration/test_context_flags.py). Past the served context
the gateway refuses, naming it."""

from __future__ import annotations

import random

import aiohttp
import pytest
import torch

from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model
from shared.model_context import for_model
from tests.conftest import drop_database, make_database
from tests.e2e.conftest import start_stack, stop_stack

# An 8k-token prefill in fp32 runs twice (the stack's, the engine's): about 3 minutes on an
# AVX2 EPYC, three times that on a machine three times slower, past the suite's 300 s.
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(1800)]

MODEL = "SmolLM2-135M-Instruct"
SERVED = 9216
PROMPT_TOKENS = 8400
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def long_stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("stack-long")
    database_url, pg_name = make_database("sqlite", tmp)
    flags = ["--dtype", "float32", "--rope-scaling", "yarn:4", "--max-model-len", str(SERVED)]
    s = start_stack(tmp, model_dir, database_url, [*flags, "--kv-cache-gb", "0.6"])
    yield s
    rc = stop_stack(s)
    drop_database(pg_name)
    assert rc == 0, f"halfmoon up exited {rc}:\n{s.log()[-3000:]}"


def prompt_ids() -> list[int]:
    rng = random.Random(29)
    return [rng.randrange(100, 40_000) for _ in range(PROMPT_TOKENS)]


def engine_answer(model_dir, ids: list[int]) -> str:
    lm = load_model(model_dir, "float32", threads=2, context=for_model(model_dir, SERVED, "yarn:4"))
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=600 << 20))
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    out: list[int] = []
    with torch.inference_mode():
        while engine.has_work():
            for o in engine.step():
                out.extend(o.new_token_ids)
    return lm.tokenizer.decode(out, skip_special_tokens=True)


async def test_a_prompt_past_the_trained_context_is_served_as_the_engine_serves_it(
    long_stack, model_dir
):
    ids = prompt_ids()
    # No client deadline of aiohttp's 5 minutes: an 8k prefill in fp32 on a slow CPU is long.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.get(f"{long_stack.url}/v1/models") as r:
            assert (await r.json())["data"][0]["max_model_len"] == SERVED
        body = {"model": MODEL, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0}
        async with http.post(f"{long_stack.url}/v1/completions", json=body) as r:
            answer = await r.json()
            assert r.status == 200, answer
        assert answer["usage"]["prompt_tokens"] == PROMPT_TOKENS
        assert answer["choices"][0]["text"] == engine_answer(model_dir, ids)
        too_long = {**body, "prompt": ids + ids[:1000]}
        async with http.post(f"{long_stack.url}/v1/completions", json=too_long) as r:
            refused = await r.json()
            assert r.status == 400, refused
        assert refused["error"]["code"] == "context_length_exceeded"
        assert str(SERVED) in refused["error"]["message"]
