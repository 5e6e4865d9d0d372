"""The engine's own sampling parameters (pure data, no pydantic, no bus).

The bus carries shared.messages.SamplingParams (validated at the gateway); a worker hands
the engine this type, made from it with `SamplingParams.of`, so the engine's inputs are
its own types, not the bus's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "lark"]


@dataclass(frozen=True)
class Constraint:
    """Structured output: what every generated text must match (llguidance compiles it).
    `spec`: a JSON schema (json_schema), a regex, a JSON list of choices, a Lark grammar,
    or nothing (json_object: any JSON object)."""

    kind: ConstraintKind
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # drop tokens under min_p x the most likely token's probability
    max_tokens: int = 256
    min_tokens: int = 0  # no stop token (EOS, stop_token_ids) before this many
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # OpenAI's: subtract presence once per seen token, frequency per occurrence (output only)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's / HF's: divide a seen token's positive logit by it, multiply a negative one
    # (prompt and output)
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k
    constraint: Constraint | None = None
    # Speculative drafts per step (None: the engine's setting; 0: none for this request).
    num_speculative_tokens: int | None = None
    # False: special tokens stay in the output text (a tool-call marker that is one).
    skip_special_tokens: bool = True

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @classmethod
    def of(cls, params: Any) -> SamplingParams:
        """The same settings from any object with these attributes (the bus message)."""
        values = {f.name: getattr(params, f.name) for f in fields(cls) if hasattr(params, f.name)}
        for name in ("stop", "stop_token_ids"):
            if name in values:
                values[name] = tuple(values[name] or ())
        bias = values.get("logit_bias")
        if isinstance(bias, dict):
            values["logit_bias"] = tuple((int(k), float(v)) for k, v in bias.items())
        constraint = values.get("constraint")
        if constraint is not None and not isinstance(constraint, Constraint):
            values["constraint"] = Constraint(constraint.kind, constraint.spec)
        return cls(**values)
