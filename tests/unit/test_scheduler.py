import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.params import SamplingParams
from shared.engine.scheduler import PoolTooSmall, Scheduler, SchedulerConfig
from shared.engine.sequence import SeqStatus, Sequence


def make(num_blocks=64, block_size=4, chunk=8, max_seqs=8):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_seqs, chunk), bm), bm


def seq(rid, n, start=0):
    toks = list(range(start, start + n))
    return Sequence(rid, toks, n, SamplingParams(max_tokens=8))


def run_step(sched, new_token=1000):
    """Apply one step as the engine would: account tokens, sample for completing ones."""
    out = sched.schedule()
    for item in out.scheduled:
        completes = item.completes
        sched.postprocess(item)
        if completes:
            item.seq.token_ids.append(new_token)
    return out


def test_long_prompt_is_chunked():
    sched, _ = make(chunk=8)
    s = seq("a", 20)
    sched.add(s)
    sizes = [[i.num_new_tokens for i in run_step(sched).scheduled] for _ in range(4)]
    assert sizes == [[8], [8], [4], [1]]  # 3 prefill chunks, then decode
    assert s.num_output_tokens == 2


def test_decodes_go_first_and_prefill_fills_the_budget():
    sched, _ = make(chunk=8)
    a, b = seq("a", 3), seq("b", 30, start=100)
    sched.add(a)
    run_step(sched)  # a prefilled
    sched.add(b)
    out = run_step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_seqs=2, chunk=100)
    for i in range(3):
        sched.add(seq(f"s{i}", 4, start=10 * i))
    out = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_pool_full_preempts_newest_and_resumes_it():
    sched, bm = make(num_blocks=6, block_size=4, chunk=64)
    a, b = seq("a", 8), seq("b", 8, start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each, 2 left
    preempted = []
    for _ in range(10):  # each decodes until a 4th block is needed and none is left
        preempted += run_step(sched).preempted
        if preempted:
            break
    assert preempted == [b] and b.status == SeqStatus.WAITING and b.num_computed_tokens == 0
    assert a.status == SeqStatus.RUNNING and bm.num_free_blocks >= 0
    produced = b.num_output_tokens
    sched.finish(a)
    out = run_step(sched)  # b is recomputed (its prefix blocks come back from the cache)
    assert b.status == SeqStatus.RUNNING and out.scheduled[0].seq is b
    assert b.num_output_tokens == produced + 1  # nothing it produced was lost or redone


def test_prompt_larger_than_pool_is_reported():
    sched, _ = make(num_blocks=2, block_size=4, chunk=64)
    sched.add(seq("huge", 20))
    with pytest.raises(PoolTooSmall):
        sched.schedule()


def test_finish_frees_blocks():
    sched, bm = make()
    s = seq("a", 10)
    sched.add(s)
    run_step(sched)
    sched.finish(s)
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_work()


def test_a_long_prefill_never_starves_decodes():
    sched, _ = make(chunk=8)
    b = seq("b", 3)
    sched.add(b)
    run_step(sched)  # b is decoding
    a = seq("a", 40, start=100)
    sched.running.insert(0, a)  # admitted "before" b in list order, still prefilling
    a.status = b.status
    for _ in range(3):
        names = [(i.seq.request_id, i.num_new_tokens) for i in run_step(sched).scheduled]
        assert names[0] == ("b", 1) and ("a", 7) in names


def test_identical_prompts_are_computed_once_and_others_go_ahead():
    """n samples of one prompt: the first computes it, the rest wait for its blocks and
    then reuse every full one; a different prompt behind them is not held up."""
    sched, bm = make(chunk=32, block_size=4)
    same = [seq(f"n{i}", 18) for i in range(3)]  # 4 cacheable blocks (16 tokens)
    other = seq("x", 6, start=500)
    for s in [*same, other]:
        sched.add(s)
    first = run_step(sched)
    assert {i.seq.request_id for i in first.scheduled} == {"n0", "x"}
    assert [s.status for s in same[1:]] == [SeqStatus.WAITING] * 2
    second = run_step(sched)  # n0's prompt is in the cache now: its siblings start
    started = {i.seq.request_id: i.num_new_tokens for i in second.scheduled}
    assert started["n1"] == started["n2"] == 2  # 18 - 16 cached tokens
    assert same[1].num_cached_tokens == same[2].num_cached_tokens == 16
