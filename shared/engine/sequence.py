"""A request inside the engine (pure bookkeeping, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from shared.engine.params import SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids are prompt + output; `num_computed_tokens` of them have KV in the pool."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    salt: str = ""
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks computed so far
    num_preemptions: int = 0
    prefill_seconds: float = 0.0  # this sequence's share of the steps that computed its prompt
    prefill_cpu_seconds: float = 0.0  # and of the engine thread's CPU time in them
    # BlockManager.prompt_key's memo: the hash of the prompt's last cacheable block.
    prompt_key: int | None = None
    prompt_key_known: bool = False
    # Speculative tokens for the next step (set by the engine before it schedules).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
