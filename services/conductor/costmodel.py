"""Predicted prefill, decode and transfer times (pure: numbers in, seconds out).

Fitted by `halfmoon profile` from the engine's own timings on this machine:
- prefill(new, cached) = polynomial regression over new tokens n and cached tokens c:
  a + b·n + d·n² + e·n·c   (attention makes it quadratic in n, and linear in n·c)
- decode step(batch, context) = a + b·batch + c·batch·context
- transfer(bytes) = latency + bytes / bandwidth
- disk load(blocks) = blocks x seconds per block (reading the disk tier back into the pool)
- pipelined prefill over a group of instances: pipeline.py, from prefill and transfer
- handoff(blocks) = a + b·blocks on top of the transfer (what decode instances measure from
  the first token to the KV in place: the offer's copy, the bus, the fetch, the import),
  times a factor drawn from the measured spread around that line when a simulator asks
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

PREFILL_TERMS = ("1", "n", "n^2", "n*c")
DECODE_TERMS = ("1", "b", "b*ctx")


def prefill_features(new: float, cached: float) -> list[float]:
    return [1.0, new, new * new, new * cached]


def decode_features(batch: float, context: float) -> list[float]:
    return [1.0, batch, batch * context]


@dataclass
class CostModel:
    # Defaults: SmolLM2-135M bf16, one thread per instance, fitted on a 2-core dev machine.
    prefill_coef: list[float] = field(default_factory=lambda: [0.017, 1.36e-3, 5.3e-7, 1.02e-6])
    decode_coef: list[float] = field(default_factory=lambda: [0.022, 1.45e-3, 1.7e-6])
    transfer_latency_s: float = 0.0005
    transfer_bytes_per_s: float = 3.2e9
    # Gateway → conductor → prefill: parsing, tokenizing, placing and bus hops. The prior's
    # is a guess; online it is the median of the prefills' dispatch samples (6 ms on a
    # local 2-core stack). The first token's way back, one bus hop, is not in it.
    overhead_s: float = 0.04
    # Prefill's first token → the request's KV in place on decode, beyond moving its bytes
    # (transfer_s): the export, the job over the bus, the reservation, the fetch's round
    # trips, the import. Not in any TTFT; the simulator adds it before a sequence joins
    # decode. Calibrated online from the decode instances' handoff samples.
    handoff_s: float = 0.0
    # The handoff's time per block beyond transfer_s: the offer writes the KV into shared
    # memory and decode verifies and imports it, copies that compete with the engines for
    # the cores (a median 70 ms for 1k-token prompts against
    # 11 ms under 256, on a loaded 2-core stack).
    handoff_s_per_block: float = 0.0
    # The spread of measured handoffs around that line: measured / line at evenly spaced
    # probabilities 0..1 (a quantile function). The policy predicts with the line; a
    # simulator draws from this. On a busy 2-core stack the handoffs of prompts under 256
    # tokens took 20 ms at the median and 118 ms at the 99th percentile: each hop (the
    # offer, the bus, the reservation, the fetch, the import) may wait for a core behind
    # the engines, and a short answer's TBT is that first gap. Empty: no spread.
    handoff_spread: list[float] = field(default_factory=list)
    # Reading one block back from an engine's disk tier into its pool (a file read, a
    # check of its tokens, a copy). The prior is a local SSD's page-cache-cold read of a
    # 368 KB block; online it is the median of the engines' disk samples.
    disk_s_per_block: float = 0.0004
    block_bytes: int = 368_640
    block_size: int = 16
    # What a pipelined prefill (pipeline.py) needs: the layers split among stages, the
    # bytes of one token's hidden state handed from stage to stage, and the prefill chunk.
    num_layers: int = 30
    hidden_bytes_per_token: int = 1152
    chunk_tokens: int = 512
    source: str = "built-in defaults (run `halfmoon profile` to fit this machine)"
    key: str = ""  # the engines it was fitted for (cpu.engine_key); empty: any

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        a, b, c, d = self.prefill_coef  # inlined prefill_features: this runs per candidate
        n = new_tokens
        t = a + b * n + c * n * n + d * n * cached_tokens
        return t if t > 0.0 else 0.0  # max(0.0, t), without the call

    def chunk_s(self, done: float, new: float, cached: float = 0.0) -> float:
        """What `new` more prompt tokens add after `done` computed ones: a chunk's share of
        the whole prefill (the first carries the fixed term), so a prompt's chunks add up
        to prefill_s of all of it."""
        before = self.prefill_s(done, cached) if done else 0.0
        return self.prefill_s(done + new, cached) - before

    def decode_step_s(self, batch: float, context: float) -> float:
        a, b, c = self.decode_coef  # inlined decode_features: this runs per decode instance
        t = a * 1.0 + b * batch + c * (batch * context)
        return t if t > 0.0 else 0.0

    def transfer_s(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.transfer_latency_s + num_blocks * self.block_bytes / self.transfer_bytes_per_s

    def disk_load_s(self, num_blocks: int) -> float:
        return max(num_blocks, 0) * self.disk_s_per_block

    def handoff_time_s(self, num_blocks: int, quantile: float | None = None) -> float:
        """Prefill's first token -> the KV of `num_blocks` in place on decode: the line, or
        with `quantile` (0..1) the handoff at that point of the measured spread."""
        line = self.handoff_s + self.handoff_s_per_block * num_blocks
        if quantile is not None and self.handoff_spread:
            line *= spread_at(self.handoff_spread, quantile)
        return line + self.transfer_s(num_blocks)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> CostModel:
        return cls(**json.loads(path.read_text()))

    def params(self) -> dict[str, float | int | list[float]]:
        """The numbers (what a conductor's heartbeat carries)."""
        d = asdict(self)
        return {k: v for k, v in d.items() if k not in ("source", "key")}

    @classmethod
    def from_params(cls, params: dict[str, Any], source: str) -> CostModel:
        """From params(); numbers this version does not know (a newer conductor's) are
        left out rather than refused."""
        known = {f.name for f in fields(cls)} - {"source", "key"}
        return cls(**{k: v for k, v in params.items() if k in known}, source=source)


def spread_at(points: list[float], quantile: float) -> float:
    """The quantile function given by `points` (its values at evenly spaced probabilities
    0..1), linearly interpolated at `quantile`."""
    if len(points) == 1:
        return points[0]
    x = min(max(quantile, 0.0), 1.0) * (len(points) - 1)
    i = min(int(x), len(points) - 2)
    return points[i] + (points[i + 1] - points[i]) * (x - i)


def least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Ordinary least squares (numpy), for the profile's fits."""
    import numpy as np

    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)
    return [float(c) for c in coef]


def default_path() -> Path:
    from shared.settings import halfmoon_home

    return halfmoon_home() / "costmodel.json"


def profile_path(key: str) -> Path:
    """Where `halfmoon profile` keeps the fit for one engine key."""
    from shared.settings import halfmoon_home

    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return halfmoon_home() / "costmodels" / f"{digest}.json"


def prior_for(key: str, explicit: str = "") -> CostModel:
    """The starting point for engines of `key`: an explicit file, else the profile fitted
    for exactly these engines (or the default file, if it was fitted for them), else the
    built-in defaults."""
    if explicit:
        return CostModel.load(Path(explicit))
    for path in (profile_path(key), default_path()):
        if path.exists():
            model = CostModel.load(path)
            if model.key in ("", key):  # a fit from before keys existed is taken as is
                return model
    return CostModel()


def load_cost_model(path: str) -> CostModel:
    """The fitted model at `path` (or the default location); built-in guesses otherwise."""
    p = Path(path) if path else default_path()
    if p.exists():
        return CostModel.load(p)
    return CostModel()
