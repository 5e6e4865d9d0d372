"""A phase-shifting synthetic trace (pure: seeded, no I/O): the workload an elastic
prefill/decode split is for (issue 31, `halfmoon plan`).

The first half is prompt-heavy (documents and RAG: long prompts, short answers), the
second output-heavy (chat and agents: short prompts, long answers). Arrivals are Poisson
at one rate throughout, so only the mix shifts: what the cluster must do per request
moves from prefill to decode, and no fixed split of its instances suits both halves.

The default lengths are sized for the built-in cost model (SmolLM2-135M on a CPU core,
services/conductor/costmodel.py): a 1k-token prompt takes ~1.9 s to prefill, and a decode
step at 40 sequences of ~500 tokens ~0.1 s. At 6 requests/s (16 instances) the document
half wants ~13 prefill instances and the chat half ~10 decode ones, so each half wants
the opposite split; twice the rate is the same for 32. Each half lasts 20 minutes by
default: the planner moves one instance per 15 s cooldown, so crossing from one half's
split to the other's takes it minutes, and a phase must be long against that for an
elastic split to pay (`halfmoon plan` measures it; README.md has the figures).

Every request is fresh: its hash ids are its own (no shared system prompt, no repeated
document), so prefix caching does not blur what the split does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from services.kvmanager.traces import TraceRequest


@dataclass(frozen=True)
class PhaseShape:
    requests: int = 14_400  # 40 minutes at 6/s: 20 minutes per half
    rate_per_s: float = 6.0
    # lognormal (mu, sigma) of tokens, then clipped to [lo, hi]
    document_input: tuple[float, float] = (math.log(1_000), 0.3)
    document_output: tuple[float, float] = (math.log(16), 0.5)
    chat_input: tuple[float, float] = (math.log(100), 0.5)
    chat_output: tuple[float, float] = (math.log(500), 0.3)
    input_range: tuple[int, int] = (16, 4_096)
    output_range: tuple[int, int] = (2, 2_048)
    block_tokens: int = 512


def _lognormal(rng: random.Random, shape: tuple[float, float], bounds: tuple[int, int]) -> int:
    return min(bounds[1], max(bounds[0], round(math.exp(rng.gauss(*shape)))))


def phase_shift_trace(shape: PhaseShape = PhaseShape(), seed: int = 0) -> list[TraceRequest]:
    """`shape.requests` Poisson arrivals; the first half documents, the second chats."""
    rng = random.Random(seed)
    bt = shape.block_tokens
    out: list[TraceRequest] = []
    t, next_id = 0.0, 0
    for i in range(shape.requests):
        t += rng.expovariate(shape.rate_per_s)
        documents = i < shape.requests // 2
        n = _lognormal(
            rng, shape.document_input if documents else shape.chat_input, shape.input_range
        )
        o = _lognormal(
            rng, shape.document_output if documents else shape.chat_output, shape.output_range
        )
        blocks = -(-n // bt)
        out.append(TraceRequest(round(t * 1000), n, o, list(range(next_id, next_id + blocks))))
        next_id += blocks
    return out
