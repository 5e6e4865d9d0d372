"""The paged engine against transformers itself, on the real model (fp32, exact).

Greedy output must be token-for-token what `generate` produces, alone and in one
continuous batch, through chunked prefill, prefix reuse, preemption and a KV handoff.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.batch import build_batch
from shared.engine.connector import HandOffAll
from shared.engine.kv_transfer import KVExport
from shared.engine.llm_engine import EngineConfig, LLMEngine, StepTime
from shared.engine.params import SamplingParams
from shared.engine.runner import load_model
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the moon.",
    "List three prime numbers.",
    "Explain in one sentence what a KV cache is.",
    "Translate 'good morning' into Spanish.",
    "def fibonacci(n):",
    "Give me a recipe for pancakes.",
    "What is 17 times 23?",
    "Who wrote Pride and Prejudice?",
    "Describe the color blue to someone who cannot see.",
    "Quelle est la capitale de l'Italie ?",
    "Name the planets of the solar system in order.",
    "Write a limerick about a cat. " * 8,
    "Summarize the history of Rome. " * 40,
    "Once upon a time, " * 120,
    "Why is the sky blue?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def lm(model_dir):
    torch.manual_seed(0)
    return load_model(model_dir, "float32", threads=2)


@pytest.fixture(scope="module")
def prompts(lm):
    return [
        lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True
        )["input_ids"]
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def reference(lm, prompts):
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = lm.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0][len(ids) :].tolist())
    return out


def greedy(max_tokens=NEW_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def drain(engine):
    tokens: dict[str, list[int]] = {}
    outputs = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            outputs[out.request_id] = out
    return tokens, outputs


def test_a_steps_cost_is_its_whole_cycle_with_the_work_between_steps(lm, prompts):
    """A running sequence waits for the whole cycle between two tokens: the step and what
    the instance did between steps (publishing, admitting), which the loop hands in."""
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    engine.add_request("r", prompts[0], greedy(4))
    engine.step()  # the prompt
    prefill = engine.cost_samples.pop()
    assert prefill.kind == "prefill" and prefill.cpu_seconds and prefill.cpu_seconds > 0
    work0 = engine.work_cpu_s
    engine.step()
    plain = engine.cost_samples.pop()
    engine.step(StepTime(wall_s=0.5, cpu_s=0.25))  # the loop took 0.5 s, 0.25 s of CPU
    cycle = engine.cost_samples.pop()
    assert plain.kind == cycle.kind == "decode" and plain.cpu_seconds is not None
    assert cycle.cpu_seconds is not None and 0.5 < cycle.seconds < 0.5 + 20 * plain.seconds
    assert 0.25 < cycle.cpu_seconds < 0.25 + 20 * plain.cpu_seconds
    # what the heartbeats report as the engines' work: the samples' CPU, nothing else
    assert engine.work_cpu_s - work0 == pytest.approx(plain.cpu_seconds + cycle.cpu_seconds)


def test_prompt_lengths_are_varied(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 40 and lengths[-1] > 600


def test_alone_matches_generate(lm, prompts, reference):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=128 << 20, max_num_batched_tokens=128))
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, greedy())
        tokens, _ = drain(engine)
        assert tokens[f"r{i}"] == reference[i], PROMPTS[i][:40]


def test_one_continuous_batch_matches_generate(lm, prompts, reference):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=256))
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, greedy())
    tokens, _ = drain(engine)
    for i in range(len(prompts)):
        assert tokens[f"r{i}"] == reference[i], PROMPTS[i][:40]


def test_logits_within_1e_4_of_transformers(lm, prompts):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    ids = prompts[13]
    seq = Sequence("x", list(ids), len(ids), greedy())
    assert engine.blocks.allocate(seq, len(ids))
    batch, _ = build_batch([ScheduledSeq(seq, len(ids))], 16, "cpu")
    ours = engine.model.forward(batch)[0]
    seq.num_computed_tokens = len(ids)
    # one decode step through the native paged kernel
    seq.token_ids.append(int(ours.argmax()))
    assert engine.blocks.allocate(seq, 1)
    batch, _ = build_batch([ScheduledSeq(seq, 1)], 16, "cpu")
    ours_next = engine.model.forward(batch)[0]
    with torch.inference_mode():
        ref = lm.model(torch.tensor([seq.token_ids])).logits[0].float()
    assert (ours - ref[-2]).abs().max().item() < 1e-4
    assert (ours_next - ref[-1]).abs().max().item() < 1e-4


def test_prefix_reuse_is_exact_and_counted(lm, prompts, reference):
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=128 << 20, max_num_batched_tokens=512))
    ids = prompts[14]
    engine.add_request("cold", ids, greedy())
    drain(engine)
    engine.add_request("warm", ids, greedy())
    tokens, outs = drain(engine)
    assert tokens["warm"] == reference[14]
    # Token-exact: every prompt token but the last (the full blocks, then the first
    # tokens of the partly filled block the cold request left).
    assert outs["warm"].num_cached_tokens == len(ids) - 1


def test_small_pool_queues_and_preempts_without_losing_anything(lm, prompts, reference):
    # 40 blocks of 16 tokens: far less than 16 prompts + outputs need at once
    engine = LLMEngine(
        lm, EngineConfig(kv_cache_bytes=40 * engine_block_bytes(lm), max_num_batched_tokens=256)
    )
    assert engine.blocks.num_blocks == 40
    chosen = [i for i, p in enumerate(prompts) if len(p) < 200]
    for i in chosen:
        engine.add_request(f"r{i}", prompts[i], greedy())
    preempted = 0
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        preempted += engine.last_step.preempted
        assert engine.blocks.num_free_blocks >= 0
    assert preempted > 0
    for i in chosen:
        assert tokens[f"r{i}"] == reference[i]
    assert engine.blocks.num_free_blocks == 40
    with pytest.raises(ValueError):  # can never fit: refused up front, not a crash later
        engine.add_request("huge", prompts[14], greedy(max_tokens=32))


def engine_block_bytes(lm) -> int:
    cfg = lm.model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 64 * 16 * 4


def test_handoff_between_engines_is_exact(lm, prompts, reference):
    prefill = LLMEngine(
        lm,
        EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=128),
        connector=HandOffAll(),
    )
    decode = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    for i in (0, 13, 14):
        prefill.add_request(f"r{i}", prompts[i], greedy())
        _, outs = drain(prefill)
        out = outs[f"r{i}"]
        assert out.handoff is not None and out.handoff.meta.num_tokens == len(prompts[i])
        wire = KVExport.from_bytes(out.handoff.meta, bytes(out.handoff.payload()))
        assert decode.add_prefilled(
            f"r{i}", prompts[i], out.new_token_ids, greedy(), wire, out.text
        )
        tokens, _ = drain(decode)
        assert out.new_token_ids + tokens[f"r{i}"] == reference[i]


class Streamer:
    """What a prefill worker that streams tells its engine: every request leaves, and
    decode holds the blocks it acked."""

    def __init__(self) -> None:
        self.acked: dict[str, int] = {}

    def hands_off(self, request_id: str) -> bool:
        return True

    def streamed_blocks(self, request_id: str) -> int:
        return self.acked.get(request_id, 0)


def on_the_wire(export: KVExport) -> KVExport:
    return KVExport.from_bytes(export.meta, bytes(export.payload()))


def stream_prefill(prefill: LLMEngine, decode: LLMEngine, streamer: Streamer, rid: str):
    """Step `prefill` to the first token; after each step its new full blocks go into
    decode's reservation, as prefill's worker sends them. Returns (output, steps)."""
    steps = 0
    while True:
        outs = prefill.step()
        steps += 1
        if outs:
            return outs[0], steps
        chunk = prefill.export_streamable(rid, streamer.acked.get(rid, 0))
        if chunk is not None:
            streamer.acked[rid] = decode.fill_reserved(rid, on_the_wire(chunk))


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 9])
def test_streamed_handoff_is_exact(lm, prompts, reference, chunks):
    """The prompt's KV streamed into decode chunk by chunk while prefill runs, the rest
    with the first token: decode's tokens are generate's."""
    ids, i = prompts[14], 14
    chunk = -(-len(ids) // chunks)
    streamer = Streamer()
    prefill = LLMEngine(
        lm,
        EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=chunk),
        connector=streamer,
    )
    decode = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    assert decode.reserve("r", ids, [], greedy(), len(ids))  # before the first chunk
    prefill.add_request("r", ids, greedy())
    out, steps = stream_prefill(prefill, decode, streamer, "r")
    assert steps == chunks and out.handoff is not None
    # What goes with the first token: the blocks of the last chunk (and the one the chunk
    # before left unfinished), not the prompt's.
    assert out.handoff.meta.first_block == streamer.acked.get("r", 0)
    assert out.handoff.meta.num_blocks <= -(-chunk // 16) + 1
    if chunks > 1:
        assert out.handoff.meta.first_block == (chunks - 1) * chunk // 16
    decode.add_reserved("r", on_the_wire(out.handoff), out.new_token_ids, out.text)
    tokens, _ = drain(decode)
    assert out.new_token_ids + tokens["r"] == reference[i]
    assert not decode.reserved and decode.stats().kv_blocks_reserved == 0


def test_a_streamed_chunk_acked_late_overlaps_the_rest_without_harm(lm, prompts, reference):
    """A chunk still in flight when the first token exists: the handoff starts at the last
    acked block, so it overlaps blocks decode has already; those are kept, and a chunk
    that would leave a gap is refused with the reservation kept."""
    ids, i = prompts[14], 14
    chunk = -(-len(ids) // 4)
    streamer, late = Streamer(), Streamer()
    prefill = LLMEngine(
        lm,
        EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=chunk),
        connector=late,  # hears of no ack: the whole KV goes with the first token
    )
    decode = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    assert decode.reserve("r", ids, [], greedy(), len(ids))
    prefill.add_request("r", ids, greedy())
    prefill.step()
    first = prefill.export_streamable("r", 0)
    assert first is not None
    gap = prefill.export_streamable("r", 1)
    assert gap is not None
    with pytest.raises(ValueError, match="a gap"):
        decode.fill_reserved("r", on_the_wire(gap))
    assert "r" in decode.reserved
    streamer.acked["r"] = decode.fill_reserved("r", on_the_wire(first))
    out, _ = stream_prefill(prefill, decode, streamer, "r")
    assert out.handoff is not None and out.handoff.meta.first_block == 0
    decode.add_reserved("r", on_the_wire(out.handoff), out.new_token_ids, out.text)
    tokens, _ = drain(decode)
    assert out.new_token_ids + tokens["r"] == reference[i]


def test_seeded_sampling_same_alone_and_split(lm, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=24)
    a = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    a.add_request("s", prompts[1], params)
    alone, _ = drain(a)
    p = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20), connector=HandOffAll())
    p.add_request("s", prompts[1], params)
    _, outs = drain(p)
    d = LLMEngine(lm, EngineConfig(kv_cache_bytes=64 << 20))
    d.add_prefilled("s", prompts[1], outs["s"].new_token_ids, params, outs["s"].handoff)
    rest, _ = drain(d)
    assert outs["s"].new_token_ids + rest["s"] == alone["s"]


def spilled(lm, prompts, tmp_path, **config) -> LLMEngine:
    """An engine with a disk tier whose DRAM pool is too small for two long prompts
    (prompts 13 and 14): after both ran, the first one's blocks have spilled to disk."""
    first, other = prompts[13], prompts[14]
    assert len(first) // 16 + len(other) // 16 > 44 and len(other) // 16 + 3 < 44
    engine = LLMEngine(
        lm,
        EngineConfig(
            kv_cache_bytes=44 * engine_block_bytes(lm),
            max_num_batched_tokens=256,
            disk_tier_bytes=64 << 20,
            disk_tier_dir=str(tmp_path / "disk"),
            **config,
        ),
    )
    for rid, prompt in (("a", first), ("b", other)):
        engine.add_request(rid, prompt, greedy())
        drain(engine)
    return engine


def test_disk_tier_brings_evicted_prefix_back(lm, prompts, reference, tmp_path):
    engine = spilled(lm, prompts, tmp_path)
    first = prompts[13]
    assert engine.disk is not None and engine.disk.nbytes > 0  # a's blocks were spilled
    engine.add_request("a2", first, greedy())
    tokens, outs = drain(engine)
    assert tokens["a2"] == reference[13]
    assert outs["a2"].num_cached_tokens == (len(first) - 1) // 16 * 16  # all of it, via disk


def test_disk_reads_are_timed_and_skipped_when_the_conductor_says_so(
    lm, prompts, reference, tmp_path
):
    """A disk hit leaves a "disk" cost sample (the conductor prices disk reads from them);
    with use_disk=False the blocks stay on disk and the prompt is computed, same tokens."""
    engine = spilled(lm, prompts, tmp_path)
    first, other = prompts[13], prompts[14]
    on_disk = len(engine.disk or [])
    assert on_disk > 0
    engine.cost_samples.clear()
    engine.add_request("a2", first, greedy(), use_disk=False)
    tokens, outs = drain(engine)
    assert tokens["a2"] == reference[13]
    assert outs["a2"].num_cached_tokens < (len(first) - 1) // 16 * 16  # not via disk
    assert not [c for c in engine.cost_samples if c.kind == "disk"]
    engine.add_request("b2", other, greedy())  # b's blocks again: from disk this time
    tokens, outs = drain(engine)
    assert tokens["b2"] == reference[14]
    disk = [c for c in engine.cost_samples if c.kind == "disk"]
    assert len(disk) == 1 and disk[0].tokens > 0 and disk[0].seconds > 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_an_unreadable_disk_block_is_recomputed_or_fails_the_request(
    lm, prompts, reference, tmp_path, policy
):
    """The KV-load failure policy on the disk tier (shared/kv_load.py): a spilled block
    whose file went bad is recomputed (the same tokens), or the request is refused with
    KVLoadError and leaves nothing behind; either way it is counted."""
    from shared.kv_load import KVLoadError

    engine = spilled(lm, prompts, tmp_path, kv_load_failure=policy)
    first, other = prompts[13], prompts[14]
    files = [f for f in (tmp_path / "disk").rglob("*") if f.is_file()]
    assert files  # a's blocks were spilled
    for f in files:
        f.write_bytes(b"not a KV block")
    counts = engine.kv_load_failures.counts
    if policy == "recompute":
        engine.add_request("a2", first, greedy())
        tokens, outs = drain(engine)
        assert tokens["a2"] == reference[13]
        assert outs["a2"].num_cached_tokens < (len(first) - 1) // 16 * 16  # not via disk
        assert dict(counts) == {("disk", "recomputed"): 1}
    else:
        with pytest.raises(KVLoadError, match="disk tier block"):
            engine.add_request("a2", first, greedy())
        assert "a2" not in engine.requests and not engine.has_work()
        assert dict(counts) == {("disk", "failed"): 1}
        engine.add_request("b2", other, greedy())  # the engine serves on
        tokens, _ = drain(engine)
        assert tokens["b2"] == reference[14]


def test_export_from_another_thread_does_not_wait_for_the_forward_pass(lm, prompts):
    """A holder exports cached blocks while its engine is inside a forward pass (the lock
    covers bookkeeping only), and what it exports is the finished prefix's KV."""
    import threading

    from shared.hashing import block_hashes

    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=128 << 20))
    prompt = prompts[13]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2))
    while engine.has_work():
        engine.step()
    hashes = block_hashes(prompt, engine.config.block_size)
    reference = engine.export_prefix(hashes)
    assert reference is not None and reference.meta.num_blocks > 0

    entered, release = threading.Event(), threading.Event()
    real_forward = engine.model.forward

    def forward(batch):  # the real forward, held open until the export is done
        entered.set()
        release.wait(10)
        return real_forward(batch)

    engine.model.forward = forward
    engine.add_request("b", prompts[14], SamplingParams(temperature=0, max_tokens=1))
    stepper = threading.Thread(target=engine.step)
    stepper.start()
    assert entered.wait(30)
    got: list = []
    exporter = threading.Thread(target=lambda: got.append(engine.export_prefix(hashes)))
    exporter.start()
    exporter.join(5)
    finished_during_forward = not exporter.is_alive()
    release.set()
    stepper.join(60)
    exporter.join(5)
    engine.model.forward = real_forward
    assert finished_during_forward, "export waited for the forward pass"
    assert torch.equal(got[0].data, reference.data)
