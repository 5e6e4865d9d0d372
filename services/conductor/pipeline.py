"""Predicted times of a pipelined prefill (CPP, Mooncake FAST'25 §3.3): pure, numbers in,
seconds out, so the conductor's policy and the simulator run the same rule.

A group of S prefill instances splits the model's layers into S contiguous ranges; the
prompt's new tokens are cut into chunks, and chunk i runs on stage s once stage s has
finished chunk i-1 and stage s-1's hidden states for chunk i have arrived (a hop over the
data plane). That is a flow shop, and its finishing times follow one recurrence:

    done[s][i] = max(done[s][i-1], done[s-1][i] + hop(i)) + work(s, i)

with done[s][-1] the moment stage s is free (its queue). The last stage's last chunk ends
the prefill: its logits give the first token.

A stage's work on a chunk is its share of the layers times what the chunk adds to the
whole prompt's predicted prefill (`CostModel.prefill_s` of everything up to the chunk's
end, less of everything before it). Summed over the chunks and the stages that is the
single instance's prediction exactly, so a group costs the same compute as one instance
and its gain comes only from the overlap, less the hops and the fill and drain of the
pipe. (Each stage pays its own per-step overhead in the live engine; `halfmoon profile`
fits the one-instance line, and a group's measured TTFT will say how much that costs.)
"""

from __future__ import annotations

from dataclasses import dataclass

from services.conductor.costmodel import CostModel


@dataclass(frozen=True, slots=True)
class StageTime:
    """One stage's part in a pipelined prefill, in seconds from now."""

    layers: tuple[int, int]
    start_s: float  # its first chunk starts
    end_s: float  # its last chunk ends (it is held until then)


def balanced_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous layer ranges as even as they go (30 in 4: 8, 7, 7, 8)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    bounds = [round(s * num_layers / stages) for s in range(stages + 1)]
    return list(zip(bounds, bounds[1:]))


def chunk_sizes(new_tokens: int, chunk_tokens: int) -> list[int]:
    """The prompt's new tokens in prefill chunks, in order (the last one may be short)."""
    full, rest = divmod(max(new_tokens, 1), chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


def chunk_work(cost: CostModel, new_tokens: int, cached_tokens: int) -> list[float]:
    """Each chunk's share of the whole prompt's predicted prefill (they sum to it)."""
    work, done = [], 0
    for n in chunk_sizes(new_tokens, cost.chunk_tokens):
        work.append(max(0.0, cost.chunk_s(done, n, cached_tokens)))
        done += n
    return work


def hop_s(cost: CostModel, tokens: int) -> float:
    """A chunk's hidden states from one stage to the next."""
    nbytes = tokens * cost.hidden_bytes_per_token
    return cost.transfer_latency_s + nbytes / cost.transfer_bytes_per_s


def pipelined(
    cost: CostModel,
    new_tokens: int,
    cached_tokens: int,
    free_at_s: list[float],
    splits: list[tuple[int, int]] | None = None,
) -> list[StageTime]:
    """The flow shop above for stages free at `free_at_s` (seconds from now, one per
    stage, in pipeline order) over `splits` (default: balanced over cost.num_layers).
    The prefill ends at the last stage's end_s."""
    splits = splits or balanced_split(cost.num_layers, len(free_at_s))
    if len(splits) != len(free_at_s):
        raise ValueError(f"{len(splits)} layer ranges for {len(free_at_s)} stages")
    sizes = chunk_sizes(new_tokens, cost.chunk_tokens)
    work = chunk_work(cost, new_tokens, cached_tokens)
    hops = [hop_s(cost, n) for n in sizes]
    arrive = [0.0] * len(sizes)  # when chunk i's input is ready for the stage at hand
    times = []
    for (first, end), free in zip(splits, free_at_s):
        share = (end - first) / cost.num_layers
        t, start = free, None
        for i, w in enumerate(work):
            t = max(t, arrive[i])
            start = t if start is None else start
            t += share * w
            arrive[i] = t + hops[i]  # on to the next stage
        times.append(StageTime((first, end), start if start is not None else free, t))
    return times


def prefill_end_s(times: list[StageTime]) -> float:
    return times[-1].end_s
