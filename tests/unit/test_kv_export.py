"""An export's leading blocks left out (what a receiver already holds) is the export that
starts after them: the same bytes and metadata, for a whole model and a stage's slice."""

from __future__ import annotations

import pytest
import torch

from shared.engine.kv_transfer import skip_blocks
from shared.engine.llm_engine import EngineConfig
from shared.engine.stage import StageRunner
from tests.factories import tiny_llama

PROMPT = [(5 * i + 2) % 300 for i in range(100)]  # 6 full blocks of 16 and a part


@pytest.mark.parametrize("layers", [(0, 3), (1, 2)], ids=["whole", "slice"])
def test_skipping_blocks_gives_the_export_that_starts_after_them(layers):
    lm = tiny_llama(layers=3)
    runner = StageRunner(lm, EngineConfig(kv_cache_bytes=4 << 20), (0, 3))
    runner.open("p", PROMPT)
    runner.run("p", len(PROMPT))
    if layers != (0, 3):  # a stage over some of the layers: its own pool, its own slice
        first = StageRunner(lm, EngineConfig(kv_cache_bytes=4 << 20), (0, 1))
        runner = StageRunner(lm, EngineConfig(kv_cache_bytes=4 << 20), layers)
        first.open("p", PROMPT)
        runner.open("p", PROMPT)
        runner.run("p", len(PROMPT), first.run("p", len(PROMPT)))
    whole = runner.export("p")
    for n in (0, 3, whole.meta.num_blocks):
        part, want = skip_blocks(whole, n), runner.export("p", n)
        assert part.meta == want.meta
        assert torch.equal(part.data, want.data)
    with pytest.raises(ValueError, match="cannot skip 8 of 7 blocks"):
        skip_blocks(whole, 8)
