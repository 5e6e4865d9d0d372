"""Sampling for a whole batch in a few tensor ops: greedy, temperature, top-k, top-p,
min-p, seeded, after the logit processors (logits.py), with logprobs when asked.

As nano-vllm does it: scale by temperature, mask by top-k, top-p and min-p for every row
at once, then draw. The draw is an inverse-CDF lookup, one uniform number per row (nano-vllm's
exponential race, argmax(p / E), needs one per vocabulary entry: on a CPU that was about
2 ms a row). Unseeded rows are drawn in one call; a seeded row draws from its own
generator, seeded from (seed, step), so a seeded request draws the same tokens wherever
it runs, prefill and decode included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.logits import RowContext, TokenLogprobs, logprobs_of, process
from shared.engine.params import SamplingParams
from shared.engine.speculative import accept_greedy

# Below this temperature sampling is greedy (as in vLLM): logits / 1e-38 overflow to inf,
# softmax turns them into NaN, and one such request would fail its whole engine step.
GREEDY_BELOW = 1e-5


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where not asked for


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW or params.top_k == 1


def _needs_processing(r: RowContext) -> bool:
    p = r.params
    return bool(
        p.logit_bias
        or p.penalized
        or r.matcher is not None
        or (r.step < p.min_tokens and r.stop_ids)
    )


def sample(logits: torch.Tensor, rows: list[RowContext]) -> Sampled:
    """Next token of each row of `logits` [M, V] (any float dtype), one per `rows` entry."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = logits[want].clone() if want else None
    if any(_needs_processing(r) for r in rows):
        logits = process(logits.float().clone(), rows)
    tokens = _draw(logits, rows)
    lps: list[TokenLogprobs | None] = [None] * len(rows)
    if raw is not None:
        got = logprobs_of(
            raw, [tokens[i] for i in want], [rows[i].params.logprobs or 0 for i in want]
        )
        for i, lp in zip(want, got):
            lps[i] = lp
    return Sampled(tokens, lps)


def _draw(logits: torch.Tensor, rows: list[RowContext]) -> list[int]:
    greedy_ids = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    if not sampled:
        return greedy_ids.tolist()
    idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
    params = [rows[i].params for i in sampled]
    probs = _probabilities(logits.index_select(0, idx).float(), params)
    picks = _draw_rows(probs, [rows[i] for i in sampled])
    return greedy_ids.index_copy(0, idx, picks).tolist()


def _draw_rows(probs: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """Inverse-CDF draws, one uniform number per row (searchsorted on the cumulative sum:
    torch.multinomial took about 1.3 ms a row on the CPU)."""
    uniform = torch.rand(probs.shape[0], dtype=probs.dtype, device=probs.device)
    for i, row in enumerate(rows):
        seed = row.params.seed
        if seed is not None:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed((seed * 1_000_003 + row.step) & 0x7FFF_FFFF_FFFF_FFFF)
            uniform[i] = torch.rand(1, generator=gen, dtype=probs.dtype)[0]
    cdf = probs.cumsum(dim=-1)
    targets = (uniform * cdf[:, -1]).unsqueeze(1)
    picks = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return picks.clamp_(max=probs.shape[1] - 1)


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled probabilities with top-k, top-p and min-p applied, per row."""
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
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        total = sorted_probs.sum(dim=-1, keepdim=True)  # min-p may have left less than 1
        # Keep the smallest set whose mass reaches top_p (the token crossing it included).
        remove = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > top_p * total
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill_(remove, 0.0))
    return probs


def verify_drafts(logits: torch.Tensor, draft: tuple[int, ...], row: RowContext) -> list[int]:
    """The tokens a step with drafts yields: the drafts the model keeps, then one of its
    own. `logits` [len(draft) + 1, V]: row j is the model's next token after the last
    known token (j = 0) or after draft j.

    Greedy keeps the drafts equal to the model's argmax: the tokens it would have chosen
    one step at a time. Sampled keeps draft j with probability p_j(draft j), and on a
    rejection draws from p_j without it (the residual of p_j against a point-mass draft,
    renormalised): every token is then distributed as p_j alone would give it (Leviathan
    et al. 2023, speculative sampling, with q a point mass)."""
    if is_greedy(row.params):
        targets = logits.argmax(dim=-1).tolist()
        kept = accept_greedy(list(draft), targets)
        return [*draft[:kept], targets[kept]]
    probs = _probabilities(logits.float().clone(), [row.params] * logits.shape[0])
    uniform = _uniforms(len(draft) + 1, row)
    for j, token in enumerate(draft):
        p = probs[j]
        if uniform[j] * p.sum() < p[token]:
            continue
        residual = p.clone()
        residual[token] = 0.0
        return [*draft[:j], _inverse_cdf(residual, uniform[-1])]
    return [*draft, _inverse_cdf(probs[-1], uniform[-1])]


def _uniforms(n: int, row: RowContext) -> torch.Tensor:
    """n uniform numbers for one row's step: from the request's seed and step if it has
    one (the same draws wherever it runs), else from the global generator."""
    if row.params.seed is None:
        return torch.rand(n, dtype=torch.float64)
    gen = torch.Generator()
    gen.manual_seed((row.params.seed * 1_000_003 + row.step) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.rand(n, generator=gen, dtype=torch.float64)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> int:
    cdf = probs.double().cumsum(dim=0)
    pick = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)[0])
    return min(pick, probs.shape[0] - 1)
