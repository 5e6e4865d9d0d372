"""Per-request sampling: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch

from shared.messages import SamplingParams

# Below this temperature sampling is greedy (as in vLLM): logits / 1e-38 overflow to inf,
# softmax turns them into NaN, and one such request would fail its whole engine step.
GREEDY_BELOW = 1e-5


class Sampler:
    """Holds one request's RNG so a seeded request is reproducible wherever it runs.

    The generator is re-seeded from (seed, step) at every token, so a request that moves
    from prefill to decode (or to another decode instance) draws the same sequence.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._gen = torch.Generator(device="cpu")

    def sample(self, logits: torch.Tensor, step: int) -> int:
        """`logits`: 1-D over the vocabulary; `step`: index of the token being produced."""
        p = self.params
        logits = logits.float().cpu()  # the seeded generator lives on the CPU, whatever the device
        if p.temperature < GREEDY_BELOW:
            return int(torch.argmax(logits).item())
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p_filter(probs, p.top_p)
        if p.seed is not None:
            self._gen.manual_seed((p.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
            return int(torch.multinomial(probs, 1, generator=self._gen).item())
        return int(torch.multinomial(probs, 1).item())


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    # Keep the smallest set whose mass reaches top_p (the token crossing it included).
    remove = cumulative - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(remove, 0.0)
    out = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return out / out.sum()
