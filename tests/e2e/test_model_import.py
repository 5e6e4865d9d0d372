"""A user's GGUF through `halfmoon model import` and served by `halfmoon up --model NAME`:
a quantized Qwen2 GGUF written by the tests (tests/gguf_files.py), converted into the
models cache, and the stack answers chat from it with the model's own chat template and
tokenizer, the engine's own greedy answer token for token (the stack's engines with
`--lean-weights`, the reference without)."""

from __future__ import annotations

import os
import subprocess
import sys

import aiohttp
import pytest
import torch

from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model
from tests.conftest import drop_database, make_database
from tests.e2e.conftest import start_stack, stop_stack
from tests.gguf_files import write_qwen2_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MESSAGES = [{"role": "user", "content": "Name three colours."}]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def imported(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("import")
    gguf = tmp / "tiny-qwen2.Q8_0.gguf"
    write_qwen2_gguf(gguf, model_dir)
    env = {**os.environ, "HALFMOON_HOME": str(tmp / "home")}  # the stack's home below
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "model", "import", str(gguf)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return tmp, done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def gguf_stack(imported):
    tmp, name = imported
    database_url, pg_name = make_database("sqlite", tmp)
    # --lean-weights: the engines hold each weight once; the answer must not change.
    s = start_stack(tmp, name, database_url, ["--dtype", "float32", "--lean-weights"])
    yield s
    rc = stop_stack(s)
    drop_database(pg_name)
    assert rc == 0, f"halfmoon up exited {rc}:\n{s.log()[-3000:]}"


def engine_answer(folder) -> str:
    lm = load_model(folder, "float32", threads=2)
    ids = lm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    out: list[int] = []
    with torch.inference_mode():
        while engine.has_work():
            for o in engine.step():
                out.extend(o.new_token_ids)
    return lm.tokenizer.decode(out, skip_special_tokens=True)


async def test_the_stack_serves_chat_from_an_imported_gguf(imported, gguf_stack):
    tmp, name = imported
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gguf_stack.url}/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [name]
        body = {"model": name, "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0}
        async with http.post(f"{gguf_stack.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
    text = answer["choices"][0]["message"]["content"]
    assert text and text == engine_answer(tmp / "home" / "models" / name)
    assert answer["usage"]["completion_tokens"] >= 1
