"""Sampling for a whole batch in a few tensor ops: greedy, temperature, top-k, top-p, seeded.

As nano-vllm does it: scale by temperature, mask by top-k and top-p, then draw every
row at once by the exponential race, argmax(p / E) with E ~ Exp(1), which picks token i
with probability p_i. No Python loop over rows and one host sync per batch; only seeded
rows draw their noise from their own generator (one op each), seeded from (seed, step),
so a seeded request draws the same tokens wherever it runs, prefill and decode included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.params import SamplingParams

# Below this temperature sampling is greedy (as in vLLM): logits / 1e-38 overflow to inf,
# softmax turns them into NaN, and one such request would fail its whole engine step.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    step: int  # index of the token being produced (0: the first output token)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW or params.top_k == 1


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """Next token of each row of `logits` [M, V] (any float dtype), one per `rows` entry."""
    greedy_ids = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    if not sampled:
        return greedy_ids.tolist()
    idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
    params = [rows[i].params for i in sampled]
    probs = _probabilities(logits.index_select(0, idx).float(), params)
    noise = _exponential_noise(probs, [rows[i] for i in sampled])
    picks = probs.div_(noise).argmax(dim=-1)
    out = greedy_ids.index_copy(0, idx, picks)
    return out.tolist()


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled probabilities with top-k and top-p applied, per row."""
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], device=device)
    logits = logits.div_(temps.unsqueeze(1))
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(logits, max(ks), dim=-1).values
        k = torch.tensor(ks, device=device)
        kth = top.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
        logits = logits.masked_fill((logits < kth) & (k > 0).unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (the token crossing it included).
        remove = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill_(remove, 0.0))
    return probs


def _exponential_noise(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for i, row in enumerate(rows):
        seed = row.params.seed
        if seed is not None:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed((seed * 1_000_003 + row.step) & 0x7FFF_FFFF_FFFF_FFFF)
            noise[i].exponential_(generator=gen)
    # A zero draw would make p / E infinite for a token of any probability, zero included.
    return noise.clamp_(min=1e-20)
