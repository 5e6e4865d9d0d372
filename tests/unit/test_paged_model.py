"""The paged forward on a random-weight Llama: native kernel and torch fallback agree, and
both match transformers' own forward (fp32). No model download needed."""

import copy

import pytest
import torch

from shared.engine import kernels
from shared.engine.batch import build_batch
from shared.engine.linear import unpack_panels
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence
from tests.factories import tiny_llama


# hidden 96: the fused ops with torch's matmuls; hidden 128 (a multiple of 64): the GEMV
# too, at every row count the decode steps bring (and a group of 4 query heads per KV head).
@pytest.fixture(scope="module", params=[(96, 6), (128, 8)])
def tiny(request):
    hidden, heads = request.param
    return tiny_llama(hidden=hidden, heads=heads)


def greedy_run(lm, native, prompts, n=12):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=4 << 20, max_num_batched_tokens=40))
    engine.model.native = native and kernels.available()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def reference(lm, prompt, n=12):
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(lm.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_native_and_fallback_match_transformers(tiny):
    prompts = [list(range(1, 30)), list(range(50, 125)), [7] * 3]
    refs = [reference(tiny, p) for p in prompts]
    assert greedy_run(tiny, native=False, prompts=prompts) == refs
    if kernels.available():
        assert greedy_run(tiny, native=True, prompts=prompts) == refs


def _bf16_decode_logits(lm, native_linears, prompts):
    """Each prompt prefilled, then one decode step of all of them as one batch: that
    step's logits [len(prompts), vocab], and the full sequences. Without native linears,
    every matmul is torch's."""
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=4 << 20))
    if not native_linears:
        for lin in [engine.model.lm_head, *(x for la in engine.model.layers for x in la.linears)]:
            lin.gemv_rows = 0
            if lin.weight is None:  # the GEMM took every row count (bf16 without AMX)
                lin.weight = unpack_panels(lin.gemv)
    seqs = []
    for i, ids in enumerate(prompts):
        seq = Sequence(f"s{i}", list(ids), len(ids), SamplingParams(temperature=0))
        assert engine.blocks.allocate(seq, len(ids))
        batch, _ = build_batch([ScheduledSeq(seq, len(ids))], 16, "cpu")
        seq.token_ids.append(int(engine.model.forward(batch)[0].argmax()))
        seq.num_computed_tokens = len(ids)
        assert engine.blocks.allocate(seq, 1)
        seqs.append(seq)
    batch, _ = build_batch([ScheduledSeq(s, 1) for s in seqs], 16, "cpu")
    return engine.model.forward(batch), [s.token_ids for s in seqs]


def test_bf16_decode_batch_is_as_close_to_transformers_as_torch_is(tiny):
    """bf16 rounds differently per kernel, so no exact match: a decode step of 20 rows
    through the native linears (the bf16 GEMM where the CPU has it) must be about as close
    to transformers' bf16 forward as with torch's own matmuls."""
    prompts = [list(range(1 + i, 8 + 7 * i)) for i in range(20)]
    errors = {}
    for native in (False, True):
        # A model of its own each time: engines over one model share its packed linears.
        model = copy.deepcopy(tiny.model).to(torch.bfloat16)
        lm = LoadedModel("tiny", model, None, torch.bfloat16, "cpu", 512, frozenset())
        logits, seqs = _bf16_decode_logits(lm, native, prompts)
        with torch.inference_mode():
            ref = torch.stack([model(torch.tensor([s])).logits[0, -1].float() for s in seqs])
        errors[native] = ((logits - ref).abs().mean() / ref.abs().mean()).item()
    assert errors[True] <= 2 * errors[False] + 1e-3, errors


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3", "dynamic"])
def test_a_stretched_rope_runs_past_the_trained_positions_as_transformers_does(kind):
    """Trained on 64 positions, stretched x4: a 150-token prompt, prefilled in chunks
    and decoded, gives transformers' own tokens under the same scaled config."""
    lm = tiny_llama(max_len=64, rope_scaling=f"{kind}:4")
    assert lm.max_model_len == 256
    prompts = [[(7 * i) % 300 for i in range(150)], list(range(1, 90))]
    refs = [reference(lm, p) for p in prompts]
    assert greedy_run(lm, native=False, prompts=prompts) == refs
    if kernels.available():
        assert greedy_run(lm, native=True, prompts=prompts) == refs


def test_past_the_context_a_prompt_is_refused_before_it_runs():
    engine = LLMEngine(tiny_llama(max_len=64), EngineConfig(kv_cache_bytes=4 << 20))
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.add_request("long", list(range(1, 100)), SamplingParams(max_tokens=2))
