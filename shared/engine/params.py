"""The engine's own sampling parameters (pure data, no pydantic, no bus).

The bus carries shared.messages.SamplingParams (validated at the gateway); a worker hands
the engine this type, made from it with `SamplingParams.of`, so the engine's inputs are
its own types, not the bus's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    @classmethod
    def of(cls, params: Any) -> "SamplingParams":
        """The same settings from any object with these attributes (the bus message)."""
        values = {f.name: getattr(params, f.name) for f in fields(cls) if hasattr(params, f.name)}
        for name in ("stop", "stop_token_ids"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)
