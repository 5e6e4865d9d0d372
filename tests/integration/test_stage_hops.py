"""A pipelined prefill's hops over the real data plane: each chunk's hidden states go
from stage to stage through a TCP sender and receiver (the transport KV uses), and the
last stage's logits are the whole model's, bit for bit the in-process pipeline's. A hop
meant for another stage or chunk is refused before anything is computed."""

from __future__ import annotations

import pytest
import torch

from shared.engine.hidden import HiddenChunk
from shared.engine.llm_engine import EngineConfig
from shared.engine.stage import StageRunner
from shared.transfer.base import HOP
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender
from tests.factories import tiny_llama

CHUNK = 40
SPLIT = [(0, 1), (1, 3), (3, 4)]


def runners(lm):
    return [StageRunner(lm, EngineConfig(kv_cache_bytes=4 << 20), r) for r in SPLIT]


async def test_hidden_states_hop_over_tcp_and_the_logits_are_the_whole_models():
    lm = tiny_llama(layers=4)
    prompt = [(13 * i + 1) % 300 for i in range(150)]
    local, remote = runners(lm), runners(lm)
    for r in local + remote:
        r.open("p", prompt)
    sender, receiver = TcpKVSender(), TcpKVReceiver()
    await sender.start()
    try:
        for pos in range(0, len(prompt), CHUNK):
            n = min(CHUNK, len(prompt) - pos)
            h = None
            for r in local:
                h = r.run("p", n, h)
            hop: HiddenChunk | None = None
            for r in remote:
                out = r.run_hop("p", n, hop)
                if r is remote[-1]:
                    break
                chunk = r.hop("p", out)
                handle = sender.offer(
                    HOP, chunk.meta.model_dump_json().encode(), chunk.payload(), n, 30
                )
                meta, payload = await receiver.fetch(handle, 30, HOP)
                hop = HiddenChunk.from_bytes(meta, payload)
                assert hop.meta.layer == r.layers[1] and hop.meta.first_token == pos
        assert torch.equal(out, h)
        with torch.inference_mode():
            want = lm.model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(out[0], want, rtol=0, atol=1e-4)
    finally:
        await sender.close()


def test_a_hop_for_another_stage_or_chunk_is_refused():
    lm = tiny_llama(layers=4)
    first, second, third = runners(lm)
    for r in (first, second, third):
        r.open("p", list(range(1, 81)))
    hop = first.hop("p", first.run("p", CHUNK))
    with pytest.raises(ValueError, match="layer 1 .here 3."):
        third.run_hop("p", CHUNK, hop)  # stage 3 starts at layer 3, this is after layer 1
    second.run_hop("p", CHUNK, hop)
    again = HiddenChunk(hop.meta.model_copy(update={"first_token": 0}), hop.data)
    with pytest.raises(ValueError, match="first_token 0 .here 40."):
        second.run_hop("p", CHUNK, again)  # the chunk it already ran
    with pytest.raises(ValueError, match="payload of 10 bytes"):
        HiddenChunk.from_bytes(hop.meta.model_dump_json().encode(), bytes(10))
