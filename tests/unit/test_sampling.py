import torch

from shared.engine.sampling import Sampler
from shared.messages import SamplingParams


def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1000, generator=g)


def test_greedy_is_argmax():
    x = logits()
    assert Sampler(SamplingParams(temperature=0)).sample(x, 0) == int(x.argmax())


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits()
    assert Sampler(SamplingParams(temperature=1.0, top_k=1)).sample(x, 3) == int(x.argmax())
    assert Sampler(SamplingParams(temperature=1.0, top_p=1e-6)).sample(x, 3) == int(x.argmax())


def test_seed_reproduces_across_sampler_instances():
    x = logits()
    p = SamplingParams(temperature=1.0, seed=7)
    a = [Sampler(p).sample(x, step) for step in range(20)]
    b = [Sampler(p).sample(x, step) for step in range(20)]
    assert a == b
    assert len(set(a)) > 1  # it does sample, not argmax


def test_top_k_restricts_support():
    x = logits()
    allowed = set(torch.topk(x, 5).indices.tolist())
    s = Sampler(SamplingParams(temperature=2.0, top_k=5, seed=1))
    assert {s.sample(x, i) for i in range(200)} <= allowed
