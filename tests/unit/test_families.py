"""Every supported family against transformers itself (fp32, random weights, each family's
real head geometry, tests/factories.py): greedy output token for token what `generate`
gives, on the native path and the torch path, through chunked prefill, prefix reuse and
a KV handoff; logits within 1e-4; Mistral's and Phi-3's sliding window across a context
longer than the window. No model download needed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shared.engine import architectures, kernels
from shared.engine.batch import build_batch
from shared.engine.connector import HandOffAll
from shared.engine.kv_transfer import KVExport, check_compatible
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence
from tests.factories import tiny_family

WINDOW = 40  # Mistral's and Phi-3's sliding window here: the prompts below run past it
CASES = [("qwen2", 0), ("qwen3", 0), ("mistral", WINDOW), ("phi3", WINDOW)]
PATHS = ["native", "torch"]
NEW = 12
PROMPTS = [
    [(7 * i + 3) % 300 for i in range(29)],
    [(11 * i + 5) % 300 for i in range(75)],  # past the window before decoding starts
    [9, 8, 7],  # runs past the window while decoding
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def lm(request):
    family, window = request.param
    return tiny_family(family, window=window)


@pytest.fixture(params=PATHS)
def native(request):
    if request.param == "native" and not kernels.available():
        pytest.skip("no native kernels here: " + kernels.status())
    return request.param == "native"


def engine(lm, native, connector=None) -> LLMEngine:
    # 40 tokens a step: the 75-token prompt prefills in chunks
    cfg = EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=40)
    e = LLMEngine(lm, cfg, connector=connector)
    e.model.native = native
    return e


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def drain(e: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while e.has_work():
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def generate(lm, prompt: list[int], n: int = NEW) -> list[int]:
    """transformers' own greedy decode (its KV cache, its sliding-window masks)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = lm.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(lm):
    return [generate(lm, p) for p in PROMPTS]


def test_the_family_is_what_the_config_names(lm):
    fam = architectures.family(lm.model.config)
    assert fam.model_type == lm.name
    windows = architectures.layer_windows(lm.model.config)
    assert windows == [WINDOW if lm.name in ("mistral", "phi3") else 0] * 2


def test_greedy_output_is_generate_s_through_chunked_prefill(lm, native, reference):
    e = engine(lm, native)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, greedy())
    out = drain(e)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == reference


def test_logits_within_1e4_of_transformers(lm, native):
    """One sequence prefilled in chunks of 32, then decoded a token a step: the logits of
    every position match transformers' forward over the whole sequence."""
    e = engine(lm, native)
    ids = PROMPTS[1] + [17, 4, 250, 33, 8]
    seq = Sequence("s", ids[:75], 75, greedy())
    got: list[torch.Tensor] = []
    done = 0
    while done < len(ids):
        n = min(32, 75 - done) if done < 75 else 1
        if done >= 75:
            seq.token_ids.append(ids[done])
        assert e.blocks.allocate(seq, n)
        batch, _ = build_batch([ScheduledSeq(seq, n)], e.blocks.block_size, "cpu", True)
        got.append(e.model.forward(batch))
        seq.num_computed_tokens = done = done + n
    with torch.inference_mode():
        want = lm.model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=1e-4)


def test_prefix_reuse_keeps_the_output(lm, native, reference):
    e = engine(lm, native)
    e.add_request("a", PROMPTS[1], greedy())
    drain(e)
    hits = e.stats().prefix_hit_tokens
    shared = PROMPTS[1][:64] + [1, 2, 3]  # four cached blocks, then new tokens
    e.add_request("b", shared, greedy())
    assert drain(e)["b"] == generate(lm, shared)
    assert e.stats().prefix_hit_tokens - hits == 64


def test_a_kv_handoff_keeps_the_output(lm, native, reference):
    prefill = engine(lm, native, connector=HandOffAll())
    decode = engine(lm, native)
    for i, p in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", p, greedy())
        outs = {}
        while prefill.has_work():
            outs.update({o.request_id: o for o in prefill.step()})
        out = outs[f"r{i}"]
        assert out.handoff is not None
        assert out.handoff.meta.architecture == architectures.family(lm.model.config).architecture
        wire = KVExport.from_bytes(out.handoff.meta, bytes(out.handoff.payload()))
        assert decode.add_prefilled(f"r{i}", p, out.new_token_ids, greedy(), wire, out.text)
        assert out.new_token_ids + drain(decode)[f"r{i}"] == reference[i]


def test_kv_of_another_family_is_refused(lm):
    e = engine(lm, native=False, connector=HandOffAll())
    e.add_request("r", PROMPTS[0], greedy())
    outs = []
    while e.has_work():
        outs += [o for o in e.step() if o.handoff is not None]
    out = outs[0]
    meta = out.handoff.meta.model_copy(update={"architecture": "SomeOtherForCausalLM"})
    with pytest.raises(ValueError, match="architecture 'SomeOtherForCausalLM'"):
        check_compatible(meta, e.kv, out.handoff.meta.model)


@pytest.mark.parametrize(
    "config,why",
    [
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
        ({"model_type": "mamba"}, "model_type 'mamba'"),
        (
            {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75},
            "partial_rotary_factor 0.75",
        ),
        ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_an_unsupported_model_is_refused_in_one_line(config, why):
    with pytest.raises(architectures.UnsupportedModel) as err:
        architectures.family(config)
    text = str(err.value)
    assert why in text and "\n" not in text
    if "serves" in text:
        assert all(arch in text for arch in architectures.MODEL_TYPES)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_instance_of_an_unsupported_model_stops_with_one_line(tmp_path, role):
    """At start, before any weights or NATS: one line on stderr, no traceback."""
    config = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", f"services.{role}", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr
    assert lines[-1].startswith(f"{role}: unsupported model architecture GemmaForCausalLM")
    assert "Qwen3ForCausalLM" in lines[-1]
