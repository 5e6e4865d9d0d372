"""The engine's concurrency contract (llm_engine.py): exports from another thread, while
the engine thread imports, allocates, evicts and steps, only ever copy the bytes their
hashes name.

Every block the test imports holds a value derived from its own hash, so an exported
block whose bytes are not its hash's value was copied while something overwrote it.
Before the contract, import_prefix changed blocks without the bookkeeping lock and this
test found such blocks within a second.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from shared.engine.kv_transfer import KVExport, KVMeta
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.hashing import block_hashes
from tests.factories import tiny_llama

BLOCK = 16
PREFIX_BLOCKS = 4


def tiny_model() -> LoadedModel:
    # Big blocks (8 layers x 8 KV heads x 64 dims) make each copy long enough to race.
    return tiny_llama(
        vocab=512, hidden=64, intermediate=64, layers=8, heads=8, kv_heads=8, head_dim=64
    )


def value_of(block_hash: int) -> float:
    return float(block_hash % 100_003) + 1.0


def export_for(engine: LLMEngine, tokens: list[int]) -> KVExport:
    """A prefix export whose every block is filled with its hash's value."""
    s = engine.kv.shape
    hashes = block_hashes(tokens, BLOCK)
    k = torch.empty(s.num_layers, len(hashes), s.num_kv_heads, s.head_dim, s.block_size)
    v = torch.empty(s.num_layers, len(hashes), s.num_kv_heads, s.block_size, s.head_dim)
    for j, h in enumerate(hashes):
        k[:, j] = value_of(h)
        v[:, j] = -value_of(h)
    meta = KVMeta(
        model="tiny",
        dtype="float32",
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_size=s.block_size,
        num_tokens=len(tokens),
        num_blocks=len(hashes),
        block_hashes=hashes,
    )
    return KVExport(meta, torch.cat([k.reshape(-1), v.reshape(-1)]))


def wrong_blocks(engine: LLMEngine, export: KVExport) -> int:
    s, n = engine.kv.shape, export.meta.num_blocks
    half = export.data.numel() // 2
    k = export.data[:half].view(s.num_layers, n, -1)
    v = export.data[half:].view(s.num_layers, n, -1)
    bad = 0
    for j, h in enumerate(export.meta.block_hashes):
        if not (torch.all(k[:, j] == value_of(h)) and torch.all(v[:, j] == -value_of(h))):
            bad += 1
    return bad


def test_exports_never_copy_a_block_being_overwritten():
    lm = tiny_model()
    # 48 blocks for 40 prefixes of 4: imports evict all the time.
    engine = LLMEngine(
        lm,
        EngineConfig(
            block_size=BLOCK,
            hot_hits=0,
            max_num_batched_tokens=64,
            kv_cache_bytes=48 * lm.num_layers * 2 * 8 * 64 * BLOCK * 4,
        ),
    )
    rng = random.Random(1)
    prefixes = [[rng.randrange(1, 512) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(40)]
    exports = [export_for(engine, p) for p in prefixes]
    stop = threading.Event()
    checked, bad = [0], [0]

    def exporter() -> None:
        r = random.Random(2)
        while not stop.is_set():
            i = r.randrange(len(prefixes))
            got = engine.export_prefix(exports[i].meta.block_hashes)
            if got is not None:
                checked[0] += got.meta.num_blocks
                bad[0] += wrong_blocks(engine, got)

    thread = threading.Thread(target=exporter)
    thread.start()
    deadline = time.monotonic() + 3.0
    try:
        n = 0
        while time.monotonic() < deadline and not bad[0]:
            i = rng.randrange(len(prefixes))
            engine.import_prefix(prefixes[i], exports[i])
            if n % 7 == 0:  # a request that allocates, steps and frees beside the imports
                engine.add_request(
                    f"r{n}",
                    [rng.randrange(1, 512) for _ in range(40)],
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                )
                while engine.has_work():
                    engine.step()
            n += 1
    finally:
        stop.set()
        thread.join()
    engine.blocks.check_invariants()
    assert checked[0] > 200, "the exporter must have copied blocks for the test to mean anything"
    assert bad[0] == 0, f"{bad[0]} of {checked[0]} exported blocks held other blocks' bytes"
