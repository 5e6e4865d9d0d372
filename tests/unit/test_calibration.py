"""The conductor's online cost model: the prior until engines report, then their truth."""

from __future__ import annotations

import random
import statistics

import pytest

from services.conductor.calibration import Calibrator
from services.conductor.costmodel import CostModel, spread_at
from shared.messages import CostSample


def slower(factor: float, prior: CostModel) -> CostModel:
    """A machine `factor` times slower, its attention share somewhat larger."""
    a, b, c, d = prior.prefill_coef
    return CostModel(
        prefill_coef=[a * factor, b * factor, c * factor * 1.5, d * factor * 1.5],
        decode_coef=[x * factor for x in prior.decode_coef],
    )


def test_without_samples_the_model_is_the_prior():
    prior = CostModel()
    model = Calibrator(prior).model()
    for n, c in ((10, 0), (300, 0), (2000, 500)):
        assert abs(model.prefill_s(n, c) - prior.prefill_s(n, c)) < 1e-9
    assert abs(model.decode_step_s(8, 700) - prior.decode_step_s(8, 700)) < 1e-9


def test_fifty_requests_teach_a_machine_the_prior_does_not_know():
    prior, rng = CostModel(), random.Random(3)
    truth = slower(2.6, prior)
    cal = Calibrator(prior)
    for _ in range(50):
        n, c = rng.randrange(20, 800), rng.choice([0, 0, 256, 1024])
        noisy = truth.prefill_s(n, c) * rng.uniform(0.93, 1.07)
        cal.observe([CostSample(kind="prefill", tokens=n, context=c, seconds=noisy)])
        b, ctx = rng.randrange(1, 48), rng.uniform(100, 1500)
        cal.observe(
            [
                CostSample(
                    kind="decode",
                    tokens=b,
                    context=ctx,
                    seconds=truth.decode_step_s(b, ctx) * rng.uniform(0.95, 1.05),
                )
            ]
        )
    model = cal.model()
    tests = [(rng.randrange(20, 800), rng.choice([0, 512])) for _ in range(200)]
    err = statistics.median(
        abs(model.prefill_s(n, c) / truth.prefill_s(n, c) - 1) for n, c in tests
    )
    prior_err = statistics.median(
        abs(prior.prefill_s(n, c) / truth.prefill_s(n, c) - 1) for n, c in tests
    )
    assert prior_err > 0.5 and err < 0.05, (prior_err, err)
    dec = [(rng.randrange(1, 48), rng.uniform(100, 1500)) for _ in range(100)]
    derr = statistics.median(
        abs(model.decode_step_s(b, x) / truth.decode_step_s(b, x) - 1) for b, x in dec
    )
    assert derr < 0.05
    assert "calibrated online on 50 prefill, 50 decode and 0 handoff samples" in model.source


def test_one_outlier_does_not_wreck_the_fit():
    prior = CostModel()
    truth = slower(1.5, prior)
    cal = Calibrator(prior)
    rng = random.Random(1)
    for i in range(40):
        n = rng.randrange(50, 600)
        y = truth.prefill_s(n, 0) * (20 if i == 7 else 1)  # a GC pause, once
        cal.observe([CostSample(kind="prefill", tokens=n, context=0, seconds=y)])
    model = cal.model()
    assert abs(model.prefill_s(300, 0) / truth.prefill_s(300, 0) - 1) < 0.15


def test_handoffs_give_the_median_time_beyond_the_transfer():
    prior = CostModel(transfer_latency_s=0.001, transfer_bytes_per_s=1e9, block_bytes=1_000_000)
    cal = Calibrator(prior)
    assert cal.model().handoff_s == prior.handoff_s == 0.0
    # 32 tokens = 2 blocks = 3 ms of transfer; the rest is the handoff's own time
    seconds = [0.053, 0.043, 0.063, 0.5]  # one stall: the median ignores it
    cal.observe(CostSample(kind="handoff", tokens=32, context=0.0, seconds=s) for s in seconds)
    model = cal.model()
    # The weighted median (later samples weigh more): 0.063 - 3 ms, not the stall's 0.5.
    assert abs(model.handoff_s - 0.060) < 1e-9
    assert model.prefill_coef == prior.prefill_coef  # handoffs move nothing else
    assert "4 handoff samples" in model.source
    assert model.handoff_s_per_block == 0.0  # one size: no slope to see


def test_handoffs_of_longer_prompts_take_longer_and_the_model_says_by_how_much():
    """The offer's copy and decode's import grow with the KV: the fit is a line in blocks,
    and one stall moves neither its level nor its slope."""
    prior = CostModel(transfer_latency_s=0.0, transfer_bytes_per_s=1e12, block_bytes=1)
    cal = Calibrator(prior)
    samples = [
        CostSample(kind="handoff", tokens=16 * blocks, context=0.0, seconds=0.004 + 0.0009 * blocks)
        for blocks in (2, 8, 20, 40, 64, 3, 10, 30, 50, 60)
    ]
    samples[4] = samples[4].model_copy(update={"seconds": 2.0})  # a stall
    cal.observe(samples)
    model = cal.model()
    assert abs(model.handoff_s - 0.004) < 1e-6
    assert abs(model.handoff_s_per_block - 0.0009) < 1e-7
    assert abs(model.handoff_time_s(64) - (0.004 + 0.0009 * 64)) < 1e-5


def test_a_machine_that_slows_under_load_is_followed_within_a_burst():
    """Eight prefills timed alone, then the cluster gets busy and the engines, sharing
    cores, run 1.5x slower: the model must follow the slowdown, not average it away."""
    prior, rng = CostModel(), random.Random(2)
    truth = slower(2.0, prior)
    cal = Calibrator(prior)
    for i in range(24):
        n = rng.randrange(200, 500)
        factor = 1.0 if i < 8 else 1.5
        cal.observe(
            [
                CostSample(
                    kind="prefill", tokens=n, context=0, seconds=truth.prefill_s(n, 0) * factor
                )
            ]
        )
    ratio = cal.model().prefill_s(330, 0) / truth.prefill_s(330, 0)
    # Equal weights with 1/y² (the old fit) said 1.23 here: the fast samples dominate.
    assert 1.38 < ratio < 1.55, ratio


def test_the_cpu_time_model_is_fit_on_its_own_samples():
    prior = CostModel()
    truth = slower(2.0, prior)
    cal = Calibrator(prior)
    assert cal.cpu_model() is None and cal.cpu_params() == {}
    rng = random.Random(4)
    for _ in range(30):
        n, b = rng.randrange(50, 600), rng.randrange(1, 32)
        cpu_p, cpu_d = truth.prefill_s(n, 0), truth.decode_step_s(b, 400)
        cal.observe(
            [  # the wall clock also held a wait for a core: 1.6x the work
                CostSample(
                    kind="prefill", tokens=n, context=0, seconds=1.6 * cpu_p, cpu_seconds=cpu_p
                ),
                CostSample(
                    kind="decode", tokens=b, context=400, seconds=1.6 * cpu_d, cpu_seconds=cpu_d
                ),
            ]
        )
    cpu, wall = cal.cpu_model(), cal.model()
    assert cpu is not None and "CPU time of 30 prefill and 30 decode" in cpu.source
    assert abs(cpu.prefill_s(300, 0) / truth.prefill_s(300, 0) - 1) < 0.05
    assert abs(cpu.decode_step_s(8, 400) / truth.decode_step_s(8, 400) - 1) < 0.05
    assert abs(wall.prefill_s(300, 0) / truth.prefill_s(300, 0) - 1.6) < 0.08
    assert cal.cpu_params()["prefill_coef"] == cpu.prefill_coef


def test_dispatches_set_the_overhead_to_their_median():
    """The way in (gateway arrival to the job on a prefill instance) is measured by every
    prefill: the model's overhead_s follows it instead of the prior's constant."""
    prior = CostModel(overhead_s=0.04)
    cal = Calibrator(prior)
    seconds = [0.011, 0.009, 0.012, 0.010, 0.9]  # one request held up: the median ignores it
    cal.observe(CostSample(kind="dispatch", tokens=100, context=0.0, seconds=s) for s in seconds)
    model = cal.model()
    assert abs(model.overhead_s - 0.011) < 1e-12
    assert model.prefill_coef == prior.prefill_coef and model.handoff_s == prior.handoff_s
    assert "overhead on 5 dispatches" in model.source


def test_the_handoffs_spread_is_their_measured_ratio_to_the_line():
    """The policy predicts a handoff with the line; a simulator draws from the spread around
    it, which on a busy stack is long-tailed (a hop waiting for a core)."""
    prior = CostModel(transfer_latency_s=0.001, transfer_bytes_per_s=1e9, block_bytes=1_000_000)
    cal = Calibrator(prior)
    assert cal.model().handoff_spread == []  # nothing measured: no spread
    # 64 tokens = 4 blocks = 5 ms of transfer; beyond it 10, 20, 30, 40 and 100 ms
    beyond = [0.010, 0.020, 0.030, 0.040, 0.100]
    cal.observe(
        CostSample(kind="handoff", tokens=64, context=0.0, seconds=0.005 + b) for b in beyond
    )
    model = cal.model()
    assert abs(model.handoff_s - 0.030) < 1e-9  # the line: their median
    spread = model.handoff_spread
    assert len(spread) == 21
    assert spread[0] == pytest.approx(1 / 3) and spread[-1] == pytest.approx(10 / 3)
    assert spread[10] == pytest.approx(1.0) and spread == sorted(spread)
    # 5% in: five ratios sit at 0, 25, .. 100%, so a fifth of the way from the smallest
    # (1/3) to the next (2/3)
    assert spread[1] == pytest.approx(0.4)
    assert model.handoff_time_s(4) == pytest.approx(0.035)  # the line, for the policy
    assert model.handoff_time_s(4, 1.0) == pytest.approx(0.105)  # the slowest measured
    assert model.handoff_time_s(4, 0.0) == pytest.approx(0.015)
    assert model.handoff_time_s(4, 0.5) == pytest.approx(0.035)


def test_spread_at_interpolates_the_quantile_function():
    points = [1.0, 2.0, 4.0]  # at 0, 0.5 and 1
    assert [spread_at(points, q) for q in (0.0, 0.25, 0.5, 0.75, 1.0)] == [1, 1.5, 2, 3, 4]
    assert spread_at(points, -1.0) == 1.0 and spread_at(points, 2.0) == 4.0
    assert spread_at([1.7], 0.3) == 1.7


def test_the_cpu_time_model_weighs_the_whole_run_alike():
    """The simulator replays a whole run: its work model is the run's average, while the
    policy's model follows the latest speed (here, a run that ends twice as slow)."""
    prior = CostModel()
    cal = Calibrator(prior)
    rng = random.Random(5)
    for i in range(400):
        b, factor = rng.randrange(1, 32), (1.0 if i < 200 else 2.0)
        t = prior.decode_step_s(b, 400) * factor
        cal.observe([CostSample(kind="decode", tokens=b, context=400, seconds=t, cpu_seconds=t)])
    cal.observe([CostSample(kind="prefill", tokens=100, context=0, seconds=0.2, cpu_seconds=0.2)])
    cpu, wall = cal.cpu_model(), cal.model()
    assert cpu is not None
    at = prior.decode_step_s(8, 400)
    assert 1.9 < wall.decode_step_s(8, 400) / at < 2.1  # the latest speed
    assert 1.3 < cpu.decode_step_s(8, 400) / at < 1.7  # the run's


def test_disk_loads_set_the_seconds_per_block_to_their_median():
    prior = CostModel()
    cal = Calibrator(prior)
    assert cal.model().disk_s_per_block == prior.disk_s_per_block
    # 32 tokens (2 blocks) in 4 ms, 160 (10) in 10 ms, 16 (1) in 30 ms: 2, 1 and 30 ms a block
    for tokens, seconds in ((32, 0.004), (160, 0.010), (16, 0.030)):
        cal.observe([CostSample(kind="disk", tokens=tokens, context=0.0, seconds=seconds)])
    model = cal.model()
    assert model.disk_s_per_block == pytest.approx(0.002)
    assert model.disk_load_s(10) == pytest.approx(0.02)
    assert "disk on 3 loads" in model.source


def test_handoffs_follow_a_link_that_got_slower_within_a_few_samples():
    """A link throttled to a tenth: the line follows it within about two half-lives of
    handoffs, though a full window of fast ones came before."""
    prior = CostModel(transfer_latency_s=0.0, transfer_bytes_per_s=1e12, block_bytes=1)
    cal = Calibrator(prior)
    sizes = [10, 20, 30, 25, 15, 28, 12, 22]

    def handoff(blocks: int, per_block: float) -> CostSample:
        return CostSample(
            kind="handoff", tokens=16 * blocks, context=0.0, seconds=0.004 + per_block * blocks
        )

    cal.observe(handoff(sizes[i % 8], 0.001) for i in range(256))
    assert abs(cal.model().handoff_time_s(20) - 0.024) < 1e-6
    cal.observe(handoff(sizes[i % 8], 0.01) for i in range(16))
    assert abs(cal.model().handoff_time_s(20) / (0.004 + 0.01 * 20) - 1) < 0.05
    assert cal.handoffs_seen == 272
