"""Decode-side prefix reuse, between a real prefill and a real decode instance over real
NATS and TCP, on a random-weight model.

A conversation's second turn repeats its first turn's prompt. The decode instance that
served the first turn caches that prompt's blocks; before the second handoff, prefill asks
what it holds, decode pins those blocks, and only the rest moves, streamed or not. The
tokens are one engine's, and the bytes are exactly the blocks decode lacked. With reuse
off the whole prompt moves, as before.
"""

from __future__ import annotations

import pytest

from shared.engine.kv_transfer import export_sequence
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import SamplingParams
from shared.messages import TokenEvent
from tests.integration.test_decode_admission import BLOCK_BYTES
from tests.integration.test_instance_faults import listen, nc, reference, tiny
from tests.integration.test_streamed_handoff import LONG, cluster, idle, paced, submit

TURN1 = LONG[:80]  # 5 full blocks of 16
TURN2 = LONG[:80] + [5, 9, 11] + LONG[83:100]  # 100 tokens: 6 full blocks and 4 more


def first_decode_event(events: list[TokenEvent], prefill_id: str) -> TokenEvent:
    return next(e for e in events if e.instance_id != prefill_id)


async def two_turns(nc, tiny, tag: str, turn1, turn2, stream: bool, reuse: bool):
    refs = [reference(tiny, turn1), reference(tiny, turn2)]
    async with cluster(nc, tiny, tag, stream=stream, reuse=reuse) as (pre, dec, _, jobs, _):
        paced(pre)
        got = []
        for i, prompt in enumerate((turn1, turn2)):
            events = await listen(nc, f"{tag}{i}")
            await submit(nc, pre, dec, f"{tag}{i}", prompt)
            await events.finished.wait()
            got.append(events.got)
            await idle(pre, dec)
        activity = dec.kv_activity
        assert not dec.engine.held and not dec.engine.reserved
    for events, ref in zip(got, refs):
        assert [t for e in events for t in e.token_ids] == ref  # greedy output unchanged
    firsts = [first_decode_event(events, pre.instance_id) for events in got]
    return jobs.got, firsts, activity


@pytest.mark.parametrize("reuse", [True, False])
async def test_the_second_turn_moves_only_the_blocks_decode_lacks(nc, tiny, reuse):
    jobs, firsts, activity = await two_turns(
        nc, tiny, f"nr{int(reuse)}", TURN1, TURN2, False, reuse
    )
    assert firsts[0].handoff_bytes == 5 * BLOCK_BYTES and firsts[0].handoff_held_tokens == 0
    if not reuse:  # the whole prompt's 7 blocks move again
        assert jobs[1].held_blocks == 0
        assert firsts[1].handoff_bytes == 7 * BLOCK_BYTES
        assert firsts[1].handoff_held_tokens == 0
        return
    assert jobs[1].held_blocks == 5  # the first turn's prompt, cached on decode
    assert firsts[1].handoff_bytes == 2 * BLOCK_BYTES  # the sixth block and the partial one
    assert firsts[1].handoff_held_tokens == 80
    assert activity.handoffs == 2 and activity.handoff_held_bytes == 5 * BLOCK_BYTES
    assert activity.handoff_bytes == 7 * BLOCK_BYTES


@pytest.mark.parametrize("reuse", [True, False])
async def test_a_streamed_second_turn_starts_its_chunks_past_what_decode_holds(nc, tiny, reuse):
    """Both turns stream (more than one prefill chunk); the second's hold reserves the
    prompt's blocks and says decode holds four, and the chunks start at the fifth."""
    turn1 = LONG[:64]  # 4 full blocks, two chunks of 32
    jobs, firsts, activity = await two_turns(nc, tiny, f"sr{int(reuse)}", turn1, LONG, True, reuse)
    assert firsts[0].handoff_held_tokens == 0
    assert firsts[0].handoff_bytes == 4 * BLOCK_BYTES
    assert jobs[1].held_blocks == 6  # 4 held, 2 streamed; 2 more came with the first token
    if not reuse:  # every chunk from the first block: nothing counted as held
        assert firsts[1].handoff_held_tokens == 0 and activity.handoff_held_bytes == 0
        assert firsts[1].handoff_bytes == 8 * BLOCK_BYTES
        return
    assert firsts[1].handoff_held_tokens == 64
    assert firsts[1].handoff_bytes == 4 * BLOCK_BYTES  # 8 blocks, 4 of them held


def test_a_held_prefix_survives_eviction_and_the_reservation_takes_only_the_rest(tiny):
    """Engine level: hold_prefix pins the cached blocks (a pool under pressure evicts
    everything else), reserve adds blocks for the rest only, and the suffix alone makes
    the same tokens as one engine."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    source = LLMEngine(tiny, EngineConfig(kv_cache_bytes=16 * BLOCK_BYTES))  # "prefill"
    source.add_request("src", TURN2, params)
    first = [t for o in source.step() for t in o.new_token_ids]
    seq = source.requests["src"].seq
    suffix = export_sequence(source.kv, source.blocks, seq, tiny.name, "none", 5)
    assert (suffix.meta.first_block, suffix.meta.num_blocks) == (5, 2)

    engine = LLMEngine(tiny, EngineConfig(kv_cache_bytes=16 * BLOCK_BYTES))  # "decode"
    engine.add_request("warm", TURN1, params)
    while engine.has_work():
        engine.step()
    assert engine.hold_prefix("r", TURN2, first, params, len(TURN2)) == 5
    assert engine.hold_prefix("r", TURN2, first, params, len(TURN2)) == 5  # asked twice
    filler = [(3 * i) % 290 + 2 for i in range(160)]  # with its answer: the 11 other blocks
    engine.add_request("filler", filler, params)
    while engine.has_work():
        engine.step()
    free_before = engine.stats().kv_blocks_free
    assert engine.reserve("r", TURN2, first, params, len(TURN2))
    assert free_before - engine.stats().kv_blocks_free == 2  # the sixth and the partial
    engine.add_reserved("r", suffix, first)
    out = list(first)
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == reference(tiny, TURN2)
    assert not engine.held and not engine.reserved


def test_a_hold_is_given_back_by_release(tiny):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine = LLMEngine(tiny, EngineConfig(kv_cache_bytes=16 * BLOCK_BYTES))
    engine.add_request("warm", TURN1, params)
    while engine.has_work():
        engine.step()
    assert engine.hold_prefix("cold", [299] * 40, [1], params, 40) == 0  # nothing cached
    assert "cold" not in engine.held
    assert engine.hold_prefix("r", TURN2, [1], params, len(TURN2)) == 5
    assert engine.stats().kv_blocks_free == 11
    assert engine.release("r") and not engine.held
    assert engine.stats().kv_blocks_free == 16
