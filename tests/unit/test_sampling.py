"""The batched sampler: greedy rows, temperature, top-k, top-p and seeds, all in one call."""

import torch

from shared.engine.logits import RowContext
from shared.engine.params import SamplingParams
from shared.engine.sampling import sample


def logits(rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 1000, generator=g)


def SampleRow(params, step):
    return RowContext(params, step)


def one(x, params, step=0):
    return sample(x, [SampleRow(params, step)]).tokens[0]


def test_greedy_is_argmax():
    x = logits()
    assert one(x, SamplingParams(temperature=0)) == int(x.argmax())


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits()
    assert one(x, SamplingParams(temperature=1.0, top_k=1), 3) == int(x.argmax())
    assert one(x, SamplingParams(temperature=1.0, top_p=1e-6), 3) == int(x.argmax())


def test_seed_reproduces_across_calls_and_batches():
    x = logits()
    p = SamplingParams(temperature=1.0, seed=7)
    a = [one(x, p, step) for step in range(20)]
    b = [one(x, p, step) for step in range(20)]
    assert a == b
    assert len(set(a)) > 1  # it does sample, not argmax
    # the same seeded row gives the same token whatever else is in its batch
    other = SamplingParams(temperature=1.0)
    batch = torch.cat([logits(seed=3), x, logits(seed=4)])
    assert (
        sample(batch, [SampleRow(other, 5), SampleRow(p, 5), SampleRow(other, 5)]).tokens[1] == a[5]
    )


def test_top_k_restricts_support():
    x = logits()
    allowed = set(torch.topk(x[0], 5).indices.tolist())
    p = SamplingParams(temperature=2.0, top_k=5)
    assert {one(x, p, i) for i in range(200)} <= allowed


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.7)
    assert {one(x, p, i) for i in range(300)} == {0, 1}


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = torch.log(probs).repeat(4000, 1)
    rows = [SampleRow(SamplingParams(temperature=1.0), 0)] * 4000
    counts = torch.bincount(torch.tensor(sample(x, rows).tokens), minlength=3).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_mixed_batch_rows_follow_their_own_params():
    x = logits(rows=3)
    rows = [
        SampleRow(SamplingParams(temperature=0), 0),
        SampleRow(SamplingParams(temperature=1.0, top_k=2, seed=1), 0),
        SampleRow(SamplingParams(temperature=0), 0),
    ]
    out = sample(x, rows).tokens
    assert out[0] == int(x[0].argmax()) and out[2] == int(x[2].argmax())
    assert out[1] in set(torch.topk(x[1], 2).indices.tolist())


def test_min_p_drops_the_unlikely_tail():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, min_p=0.35)  # keeps tokens >= 0.175
    assert {one(x, p, i) for i in range(300)} == {0, 1}


def test_logit_bias_and_min_tokens():
    x = logits()
    best = int(x.argmax())
    biased = SamplingParams(temperature=0, logit_bias=((7, 100.0),))
    assert one(x, biased) == 7
    banned = SamplingParams(temperature=0, min_tokens=3)
    row = RowContext(banned, step=1, stop_ids=frozenset({best}))
    assert sample(x, [row]).tokens[0] != best  # the stop token is out until 3 tokens
    row = RowContext(banned, step=3, stop_ids=frozenset({best}))
    assert sample(x, [row]).tokens[0] == best


def test_penalties_follow_openai_and_vllm():
    x = torch.zeros(1, 6)
    x[0, 2], x[0, 3] = 2.0, 1.9
    seen = [2, 2]  # the output so far: token 2 twice

    def pick(**kw):
        row = RowContext(
            SamplingParams(temperature=0, **kw), step=2, token_ids=[5] + seen, num_prompt_tokens=1
        )
        return sample(x.clone(), [row]).tokens[0]

    assert pick() == 2
    assert pick(presence_penalty=0.2) == 3  # 2.0 - 0.2 < 1.9
    assert pick(frequency_penalty=0.06) == 3  # 2.0 - 2 x 0.06 < 1.9
    assert pick(frequency_penalty=0.04) == 2  # 2.0 - 0.08 > 1.9
    assert pick(repetition_penalty=1.1) == 3  # 2.0 / 1.1 < 1.9


def test_logprobs_are_the_models_own_and_top_k_sorted():
    x = logits()
    row = RowContext(SamplingParams(temperature=0, logprobs=3), 0)
    got = sample(x.clone(), [row])
    lp = torch.log_softmax(x[0], -1)
    top = got.logprobs[0]
    assert top.token_id == int(x.argmax()) and abs(top.logprob - float(lp.max())) < 1e-5
    assert [t for t, _ in top.top] == torch.topk(lp, 3).indices.tolist()
    assert sample(x, [RowContext(SamplingParams(temperature=0), 0)]).logprobs == [None]
