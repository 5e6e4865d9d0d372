"""The stack on the AVX2 path, whatever CPU runs the tests: HALFMOON_CPU_ISA=avx2 caps
the flags the engines see, the native kernels' -march, and ATen's and oneDNN's dispatch,
as on an AVX2-only EPYC. `--dtype auto` must then pick float32 (bf16 would be emulated),
and a chat must still match transformers token for token."""

from __future__ import annotations

import pytest

from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_chat import reference, stream_chat  # fixtures, used by name

pytestmark = [pytest.mark.e2e, pytest.mark.model]


@pytest.fixture(scope="module")
def avx2_stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("stack-avx2")
    database_url, _ = make_database("sqlite", tmp)
    s = start_stack(tmp, model_dir, database_url, env={"HALFMOON_CPU_ISA": "avx2"})
    yield s
    assert stop_stack(s) == 0, s.log()[-3000:]


async def test_auto_dtype_is_float32_and_chat_matches_transformers(avx2_stack, reference):
    log = avx2_stack.log()
    assert "engines  float32 (auto: no native bf16" in log, log[-3000:]
    assert "kernels for avx2, capped by HALFMOON_CPU_ISA=avx2" in log
    engine_lines = [line for line in log.splitlines() if "native kernels:" in line]
    assert len(engine_lines) == 2 and all(
        "built for avx2" in line and "float32" in line for line in engine_lines
    ), engine_lines
    assert all(
        "torch dispatch AVX2" in line for line in log.splitlines() if "torch dispatch" in line
    )
    for prompt in ("What is the capital of France?", "Write a haiku about the moon."):
        _, ref_text = reference(prompt, 32)
        text, _ = await stream_chat(avx2_stack.url, prompt, 32)
        assert text == ref_text, prompt
