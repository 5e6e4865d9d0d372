"""Pipelined prefill's stages on a random-weight Llama: split into 2 or 3 stages, each over
its own pool, a prompt of 1 to 4 chunks gives the whole model's last-token logits (within
1e-4 of transformers, native path and torch path), and each stage's pool holds exactly
the KV the whole model's pool holds for its layers."""

from __future__ import annotations

import pytest
import torch

from shared.engine import kernels
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.stage import NoRoom, StageRunner
from tests.factories import tiny_llama

LAYERS = 4
CHUNK = 40
SPLITS = {
    "whole": [(0, 4)],
    "2 stages": [(0, 2), (2, 4)],
    "3 stages": [(0, 1), (1, 3), (3, 4)],
}
PATHS = [False, True] if kernels.available() else [False]


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(layers=LAYERS)


def prompt_of(chunks: int) -> list[int]:
    n = CHUNK * (chunks - 1) + 30  # 1 chunk: 30 tokens; 4 chunks: 150
    return [(11 * i + 5) % 300 for i in range(n)]


def stages(lm, split, native: bool, kv_bytes: int = 4 << 20) -> list[StageRunner]:
    runners = [StageRunner(lm, EngineConfig(kv_cache_bytes=kv_bytes), r) for r in split]
    for r in runners:
        r.model.native = native
    return runners


def pipeline(runners: list[StageRunner], rid: str, prompt: list[int], start: int = 0):
    """The prompt through every stage, a chunk at a time; the last stage's logits."""
    logits = None
    for pos in range(start, len(prompt), CHUNK):
        n = min(CHUNK, len(prompt) - pos)
        h = None
        for r in runners:
            h = r.run(rid, n, h)
        logits = h
    assert logits is not None
    return logits


def hf_last_logits(lm, prompt):
    with torch.inference_mode():
        return lm.model(torch.tensor([prompt])).logits[0, -1]


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("split", list(SPLITS), ids=str)
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_a_split_model_gives_the_whole_models_logits(lm, split, chunks, native):
    prompt = prompt_of(chunks)
    runners = stages(lm, SPLITS[split], native)
    for r in runners:
        assert r.open("p", prompt) == 0
    logits = pipeline(runners, "p", prompt)
    assert logits.shape == (1, 300)
    torch.testing.assert_close(logits[0], hf_last_logits(lm, prompt), rtol=0, atol=1e-4)


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "torch")
def test_each_stage_holds_the_whole_models_kv_for_its_layers(lm, native):
    prompt = prompt_of(4)
    whole = LLMEngine(lm, EngineConfig(kv_cache_bytes=4 << 20, max_num_batched_tokens=CHUNK))
    whole.model.native = native
    whole.add_request("w", prompt, SamplingParams(temperature=0, max_tokens=1))
    while whole.has_work():
        whole.step()
    pool = whole.blocks  # the finished prompt's blocks stay cached by hash
    ids = pool.cached_chain(pool.cached_hashes())
    runners = stages(lm, SPLITS["3 stages"], native)
    for r in runners:
        r.open("p", prompt)
    pipeline(runners, "p", prompt)
    full = len(prompt) // 16  # the full blocks: the ones the whole engine cached
    for r in runners:
        first, end = r.layers
        mine = r.block_table("p")[:full]
        assert torch.equal(r.kv.k[:, mine], whole.kv.k[first:end, ids[:full]])
        assert torch.equal(r.kv.v[:, mine], whole.kv.v[first:end, ids[:full]])


def test_a_stages_prefix_cache_and_rewinding_to_the_groups_least_hit(lm):
    prompt = prompt_of(4)
    runners = stages(lm, SPLITS["2 stages"], native=False)
    for r in runners:
        r.open("a", prompt)
    first = pipeline(runners, "a", prompt)
    for r in runners:
        r.close("a")
    # Stage 0 still holds the prompt's full blocks; stage 1 loses them (a fresh pool).
    runners[1] = stages(lm, [(2, 4)], native=False)[0]
    hits = [r.open("b", prompt) for r in runners]
    assert hits == [144, 0]  # 9 full blocks of 16; the last token is always computed
    start = min(hits)
    for r in runners:
        r.rewind("b", start)
    again = pipeline(runners, "b", prompt, start)
    torch.testing.assert_close(again, first, rtol=0, atol=1e-5)


def test_stages_refuse_what_they_cannot_run(lm):
    with pytest.raises(ValueError, match=r"layers \[3, 2\)"):
        StageRunner(lm, EngineConfig(kv_cache_bytes=1 << 20), (3, 2))
    with pytest.raises(ValueError, match=r"layers \[0, 5\)"):
        StageRunner(lm, EngineConfig(kv_cache_bytes=1 << 20), (0, 5))
    first, second = stages(lm, SPLITS["2 stages"], native=False)
    first.open("p", prompt_of(1))
    second.open("p", prompt_of(1))
    with pytest.raises(ValueError, match="first stage takes token ids"):
        first.run("p", 10, torch.zeros(10, 96))
    with pytest.raises(ValueError, match="first stage takes token ids"):
        second.run("p", 10)
    with pytest.raises(ValueError, match="11 hidden rows for 10 tokens"):
        second.run("p", 10, torch.zeros(11, 96))
    with pytest.raises(ValueError, match="40 tokens asked, 30 left"):
        first.run("p", 40)
    with pytest.raises(ValueError, match="already open"):
        first.open("p", [1, 2])
    # A pool of two blocks: the third block's chunk finds no room, and nothing is taken.
    tiny_pool = 2 * first.kv.shape.block_nbytes
    small = stages(lm, [(0, 2)], native=False, kv_bytes=tiny_pool)[0]
    small.open("q", prompt_of(2))
    small.run("q", 32)
    with pytest.raises(NoRoom):
        small.run("q", 16)
    assert small.blocks.num_free_blocks == 0 and len(small.block_table("q")) == 2


def greedy_reference(lm, prompt, n):
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("split", ["2 stages", "3 stages"])
def test_a_pipelined_prompt_hands_its_slices_to_decode_and_decodes_as_transformers(
    lm, split, native
):
    """The stages stream their layers of the full blocks after the second chunk (last
    stage first: decode takes slices in any order), the rest after the first token; the
    decode engine, whole, continues from them token for token as transformers does."""
    prompt, n = prompt_of(4), 12
    runners = stages(lm, SPLITS[split], native)
    for r in runners:
        r.open("p", prompt)
    decode = LLMEngine(lm, EngineConfig(kv_cache_bytes=4 << 20))
    decode.model.native = native
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    assert decode.reserve("p", prompt, [], params, len(prompt))
    sent = [0] * len(runners)
    logits = None
    for i, pos in enumerate(range(0, len(prompt), CHUNK)):
        h = None
        for r in runners:
            h = r.run("p", min(CHUNK, len(prompt) - pos), h)
        logits = h
        if i == 1:
            for k in reversed(range(len(runners))):
                chunk = runners[k].export_full("p", sent[k])
                assert chunk is not None and chunk.meta.first_layer == runners[k].layers[0]
                decode.fill_reserved_slice("p", chunk)
                sent[k] += chunk.meta.num_blocks
    assert logits is not None
    first = int(logits[0].argmax())
    with pytest.raises(ValueError, match="in every layer"):  # the tails are still away
        decode.add_reserved_slices("p", [first])
    for k, r in enumerate(runners):
        decode.fill_reserved_slice("p", r.export("p", sent[k]))
    decode.add_reserved_slices("p", [first])
    out = [first]
    while decode.has_work():
        for o in decode.step():
            out.extend(o.new_token_ids)
    assert out == greedy_reference(lm, prompt, n)
    # The prompt's full blocks are now decode's prefix cache, in every layer.
    assert decode.blocks.num_cached_blocks >= len(prompt) // 16


def test_a_slice_outside_the_pools_layers_or_of_another_shape_is_refused(lm):
    runners = stages(lm, SPLITS["2 stages"], native=False)
    runners[0].open("p", prompt_of(2))
    runners[0].run("p", 40)
    part = runners[0].export("p")
    decode = LLMEngine(lm, EngineConfig(kv_cache_bytes=4 << 20))
    assert decode.reserve("p", prompt_of(2), [], SamplingParams(max_tokens=4), 70)
    with pytest.raises(ValueError, match="incompatible"):
        decode.fill_reserved("p", part)  # a slice is not a whole block's KV
    bad = part.meta.model_copy(update={"first_layer": 3})  # layers 3..5 of a 4-layer model
    with pytest.raises(ValueError, match="not within"):
        decode.fill_reserved_slice("p", type(part)(bad, part.data))
