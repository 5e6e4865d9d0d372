"""Export/import of a sequence's KV: a handoff in the middle changes nothing.

Uses a random-weight Llama of the real architecture (fewer layers): no model download.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.engine.kv_codec import KVMeta, check_compatible
from shared.engine.runner import LoadedModel, ModelRunner


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=256)
    dtype = getattr(torch, request.param)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    lm = LoadedModel("tiny", model, None, dtype, "cpu", 256, frozenset())
    return ModelRunner(lm)


def greedy(runner, cache, first, n):
    out = [first]
    for _ in range(n):
        out.append(int(runner.decode_step(cache, out[-1]).argmax()))
    return out


def test_handoff_is_exact(runner):
    prompt = list(range(3, 40))
    logits, cache = runner.prefill(prompt)
    first = int(logits.argmax())
    meta, payload = runner.export(cache, block_size=16, block_hashes=[1, 2])
    assert meta.num_tokens == len(prompt) and meta.nbytes == len(payload)
    moved = runner.import_(KVMeta.model_validate_json(meta.model_dump_json()), bytes(payload))
    _, fresh = runner.prefill(prompt)
    assert greedy(runner, moved, first, 12) == greedy(runner, fresh, first, 12)


def test_mismatched_kv_is_refused(runner):
    _, cache = runner.prefill([1, 2, 3])
    meta, payload = runner.export(cache)
    with pytest.raises(ValueError):
        check_compatible(meta, "other-model", runner.lm.dtype, runner.lm.num_layers)
    with pytest.raises(ValueError):
        runner.import_(meta, bytes(payload)[:-2])
