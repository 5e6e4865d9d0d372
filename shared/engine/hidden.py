"""A pipelined prefill's hop: one chunk's residual stream, from the stage that ran the
layers before to the one that runs the next (stage.py), as contiguous bytes plus the
metadata the receiving stage checks before it computes on them (over the same data plane
as KV: shared/transfer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict

from shared.engine.kv_transfer import DTYPES


class HiddenMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    dtype: str
    hidden_size: int
    layer: int  # the stream after layers 0 .. layer-1: the next stage starts at `layer`
    first_token: int  # the chunk's first position in the prompt
    num_tokens: int


@dataclass
class HiddenChunk:
    meta: HiddenMeta
    data: torch.Tensor  # [num_tokens, hidden_size], contiguous, on CPU

    @classmethod
    def of(cls, model: str, hidden: torch.Tensor, layer: int, first_token: int) -> HiddenChunk:
        name = next(n for n, dt in DTYPES.items() if dt == hidden.dtype)
        meta = HiddenMeta(
            model=model,
            dtype=name,
            hidden_size=hidden.shape[1],
            layer=layer,
            first_token=first_token,
            num_tokens=hidden.shape[0],
        )
        return cls(meta, hidden.contiguous().cpu())

    def payload(self) -> memoryview:
        return self.data.view(torch.uint8).numpy().data.cast("B")

    @classmethod
    def from_bytes(cls, meta: bytes, payload: bytes | bytearray | memoryview) -> HiddenChunk:
        m = HiddenMeta.model_validate_json(meta)
        if m.dtype not in DTYPES:
            raise ValueError(f"hidden states of dtype {m.dtype!r}")
        dtype = DTYPES[m.dtype]
        want = m.num_tokens * m.hidden_size * dtype.itemsize
        if len(payload) != want or want == 0:
            raise ValueError(
                f"hidden payload of {len(payload)} bytes, not {want} "
                f"({m.num_tokens} x {m.hidden_size} {m.dtype})"
            )
        buf = bytearray(payload) if isinstance(payload, bytes) else payload
        data = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
        return cls(m, data.view(m.num_tokens, m.hidden_size))

    def check_for(self, model: str, dtype: torch.dtype, layer: int, next_token: int) -> None:
        """ValueError unless these are the states a stage of `model` starting at `layer`
        needs next, for the token it has to compute next."""
        m, want = self.meta, next(n for n, dt in DTYPES.items() if dt == dtype)
        wrong = [
            f"{k} {got!r} (here {exp!r})"
            for k, got, exp in (
                ("model", m.model, model),
                ("dtype", m.dtype, want),
                ("layer", m.layer, layer),
                ("first_token", m.first_token, next_token),
            )
            if got != exp
        ]
        if wrong:
            raise ValueError("hidden states for another stage or chunk: " + ", ".join(wrong))
