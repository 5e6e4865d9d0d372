"""How hot each cached prefix is: its hit rate, decayed over time (pure: `now` comes in).

Mooncake Store counts each key's heat and copies hot objects to more holders. Here the
key is a KV block: every request that finds a leading run of its blocks cached somewhere
adds one hit to each block of that run. A prefix is then as hot as its last block, since
every request that hits a block also hit the blocks before it. The conductor asks for the
longest leading run of a request's blocks at least `min_rps` hot, and copies that run to
more prefill instances when its holders cannot carry its load (conductor/replication.py).

A block's count decays exponentially with a half-life, so a steady rate r settles at
r x tau (tau = half-life / ln 2) and the rate read back is count / tau: a prefix that goes
cold stops counting as hot within a few half-lives, and one that turns hot climbs as fast
as its hits come. The table is bounded: past `max_blocks`, the coldest half is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(slots=True)
class _Count:
    value: float
    at: float


class PrefixHeat:
    def __init__(self, half_life_s: float = 30.0, max_blocks: int = 100_000) -> None:
        if half_life_s <= 0 or max_blocks < 1:
            raise ValueError(
                f"need half_life_s > 0 and max_blocks >= 1, got {half_life_s}, {max_blocks}"
            )
        self.tau_s = half_life_s / math.log(2)
        self.max_blocks = max_blocks
        self._counts: dict[int, _Count] = {}

    def _decayed(self, c: _Count, now: float) -> float:
        return c.value * math.exp(-max(0.0, now - c.at) / self.tau_s)

    def hit(self, hashes: Sequence[int], now: float) -> None:
        """One request found these leading blocks cached: each gets a hit."""
        counts = self._counts
        for h in hashes:
            c = counts.get(h)
            if c is None:
                counts[h] = _Count(1.0, now)
            else:
                c.value, c.at = self._decayed(c, now) + 1.0, now
        if len(counts) > self.max_blocks:
            self._prune(now)

    def rate(self, block_hash: int, now: float) -> float:
        """The block's hits per second, as the decayed count estimates it."""
        c = self._counts.get(block_hash)
        return self._decayed(c, now) / self.tau_s if c is not None else 0.0

    def hot_run(self, hashes: Sequence[int], now: float, min_rps: float) -> tuple[int, float]:
        """(blocks, rate): the longest leading run of `hashes` hit at least `min_rps` times
        a second, and the rate of its last block (the whole run's: see the module doc).
        (0, 0.0) when the first block is not that hot."""
        n, rps = 0, 0.0
        for h in hashes:
            r = self.rate(h, now)
            if r < min_rps:
                break
            n, rps = n + 1, r
        return n, rps

    def _prune(self, now: float) -> None:
        """Keep the hotter half: a cold block's heat would decay to nothing anyway."""
        ranked = sorted(self._counts.items(), key=lambda kv: self._decayed(kv[1], now))
        for h, _ in ranked[: len(ranked) - self.max_blocks // 2]:
            del self._counts[h]

    def __len__(self) -> int:
        return len(self._counts)
