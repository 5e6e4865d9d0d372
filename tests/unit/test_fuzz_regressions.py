"""Inputs the gateway fuzzer (tests/e2e/test_fuzz.py) found breaking something, kept here
as fast checks against the real code."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.gateway.protocol import parse_request
from shared.engine.logits import RowContext
from shared.engine.params import SamplingParams
from shared.engine.sampling import sample


def test_tiny_temperatures_sample_greedily_instead_of_failing():
    # temperature=1e-38 made logits / T overflow, softmax NaN, multinomial raise: the whole
    # engine step failed (a 500 in the stream of every request in the batch).
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(0)) * 5
    best = int(torch.argmax(logits))
    for t, k, p, seed in itertools.product(
        [1e-6, 1e-38, 1e-45, 5e-324], [0, 2, 10**9], [1.0, 0.5, 5e-324], [None, 7]
    ):
        params = SamplingParams(temperature=t, top_k=k, top_p=p, seed=seed)
        assert sample(logits, [RowContext(params, 0)]).tokens == [best]


def test_integral_floats_are_integers_as_the_schema_says():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    req = parse_request({**body, "n": 1.0, "max_tokens": 8.0, "top_k": 0.0})
    assert (req.n, req.max_tokens, req.top_k) == (1, 8, 0)
    assert isinstance(req.max_tokens, int)
    for bad in ({"max_tokens": 8.5}, {"max_tokens": "8"}, {"n": float("inf")}):
        with pytest.raises(Exception, match="valid integer"):
            parse_request({**body, **bad})
