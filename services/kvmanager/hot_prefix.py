"""A skewed "hot prefix" trace (pure: seeded, no I/O): the workload that replicating a hot
prefix's blocks is for.

Most real prefix sharing is skewed: one system prompt, one tool manifest, one few-shot
preamble starts a large share of all requests. Served from one instance, that prefix's
blocks make the instance holding them a hotspot; replicating them spreads the load. This
trace isolates that case:

- arrivals: Poisson at `rate` requests/s;
- a share `hot_share` of the requests (80% by default) starts with ONE prefix of
  `hot_prefix_tokens` tokens (whole blocks, the same hash ids in every such request),
  then its own fresh suffix of `own_tokens` tokens (a trailing partial block is fresh too);
- the other requests are fresh prompts of the same length (`hot_prefix_tokens +
  own_tokens`), so the two kinds differ only in the prefix they share, or of
  `fresh_tokens` (as short as a hot request's own part, say, so that a small machine can
  carry them beside a hot prefix that overloads one instance);
- every output is `output_tokens` long, so decode does not blur what the prefix does;
- before `hot_start_s` only a share `warm_share` (none by default) starts with it: a prefix
  that turns hot suddenly (a new system prompt deployed, or a lukewarm one that goes
  viral, cached so far on the few instances its rare requests went to), for how fast
  replication reacts.

Which requests are hot, and the arrivals, do not depend on `hot_start_s`: a trace with a
later start is the same trace with its early hot requests made fresh. Hash ids number
blocks of `block_tokens` tokens in order of first use, as in the released traces. With
the defaults (4 shared blocks of 6), the ideal prefix hit ratio is about 0.8 x 4/6 = 53%.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from services.kvmanager.traces import FreshIds, TraceRequest


@dataclass(frozen=True)
class HotPrefixShape:
    requests: int = 2_000
    rate: float = 4.0  # arrivals per second
    hot_share: float = 0.8  # of requests: start with the hot prefix
    hot_prefix_tokens: int = 2_048  # whole blocks
    own_tokens: int = 1_024  # each request's own suffix, after the prefix
    output_tokens: int = 32
    block_tokens: int = 512
    hot_start_s: float = 0.0  # before this, would-be hot requests are fresh
    warm_share: float = 0.0  # of requests before hot_start_s: start with the prefix
    fresh_tokens: int = 0  # the other requests' length (0: hot_prefix_tokens + own_tokens)

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a positive number of requests/s, got {self.rate}")
        if not 0.0 <= self.hot_share <= 1.0:
            raise ValueError(f"hot_share must be in [0, 1], got {self.hot_share}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.hot_prefix_tokens < 1 or self.hot_prefix_tokens % self.block_tokens:
            raise ValueError(
                f"hot_prefix_tokens must be a positive multiple of block_tokens "
                f"({self.block_tokens}), got {self.hot_prefix_tokens}"
            )
        if self.own_tokens < 1:
            raise ValueError(f"own_tokens must be >= 1, got {self.own_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        if self.fresh_tokens < 0:
            raise ValueError(f"fresh_tokens must be >= 0, got {self.fresh_tokens}")
        if not 0.0 <= self.warm_share <= self.hot_share:
            raise ValueError(f"warm_share must be in [0, hot_share], got {self.warm_share}")
        if not (math.isfinite(self.hot_start_s) and self.hot_start_s >= 0):
            raise ValueError(f"hot_start_s must be >= 0, got {self.hot_start_s}")


def hot_prefix_trace(shape: HotPrefixShape = HotPrefixShape(), seed: int = 0) -> list[TraceRequest]:
    """`shape.requests` Poisson arrivals, a `hot_share` of them on the one hot prefix."""
    rng = random.Random(seed)
    bt = shape.block_tokens
    n = shape.hot_prefix_tokens + shape.own_tokens
    n_fresh = shape.fresh_tokens or n
    fresh = FreshIds().take
    hot_ids: list[int] = []  # numbered at the first hot request, in order of first use

    out: list[TraceRequest] = []
    t = 0.0
    for _ in range(shape.requests):
        t += rng.expovariate(shape.rate)
        ms = round(t * 1000)
        # drawn for every request, so hot_start_s changes only which hot requests are fresh
        share = shape.hot_share if ms >= shape.hot_start_s * 1000 else shape.warm_share
        hot = rng.random() < share
        if hot:
            hot_ids = hot_ids or fresh(shape.hot_prefix_tokens // bt)
            ids = hot_ids + fresh(-(-shape.own_tokens // bt))
        else:
            ids = fresh(-(-n_fresh // bt))
        out.append(TraceRequest(ms, n if hot else n_fresh, shape.output_tokens, ids))
    return out


def hot_requests(trace: Sequence[TraceRequest]) -> int:
    """How many requests start with the hot prefix: those whose first block is the most
    shared one (0 where no first block is shared: a lone hot request shares nothing)."""
    counts = Counter(r.hash_ids[0] for r in trace if r.hash_ids)
    top = max(counts.values(), default=0)
    return top if top > 1 else 0
