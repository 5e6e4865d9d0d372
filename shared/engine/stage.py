"""One stage of a pipelined prefill: a contiguous range of the model's layers over a KV pool
of its own, run a chunk at a time (Mooncake's chunked pipeline parallelism, FAST'25 §3.3).

A long prompt is cut into chunks. Stage 0 embeds chunk i and runs its layers while stage 1
runs chunk i-1 on the hidden states stage 0 handed it, and so on; the last stage's logits
of the prompt's last token give the first token. No all-reduce between stages: each hop
carries one chunk's residual stream ([tokens, hidden], a few hundred KiB), and each stage
keeps the KV of its own layers, which the decode handoff gathers from all of them.

This is the engine's side only: no bus, no sockets. The prefill service drives the chunks
and moves the hidden states between stages. A stage's prefix cache works as an engine's
does, by the same block hashes; since every stage of a group must start a prompt at the
same token, the driver takes the least of their hits and `rewind`s the others to it.
"""

from __future__ import annotations

import torch

from shared.engine.batch import build_batch
from shared.engine.block_manager import BlockManager
from shared.engine.engine_types import EngineConfig
from shared.engine.hidden import HiddenChunk
from shared.engine.kv_cache import KVCache
from shared.engine.kv_transfer import KVExport, export_full_blocks, export_sequence
from shared.engine.model import PagedModel
from shared.engine.params import SamplingParams
from shared.engine.runner import LoadedModel
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence


class NoRoom(RuntimeError):
    """The stage's pool cannot take the chunk's blocks now (nothing was taken)."""


class StageRunner:
    def __init__(self, lm: LoadedModel, config: EngineConfig, layers: tuple[int, int]) -> None:
        self.lm = lm
        self.config = config
        shape = PagedModel.kv_shape(lm.config, config.block_size, lm.dtype, layers)
        num_blocks = shape.num_blocks_for(config.kv_cache_bytes)
        self.kv = KVCache(shape, num_blocks, lm.device)
        self.model = PagedModel(
            lm.model, self.kv, config.quantization, layers, lean=config.lean_weights
        )
        self.blocks = BlockManager(num_blocks, config.block_size, config.hot_hits, config.pin_ttl_s)
        self.seqs: dict[str, Sequence] = {}

    @property
    def layers(self) -> tuple[int, int]:
        return self.model.first_layer, self.model.end_layer

    def open(self, seq_id: str, prompt_token_ids: list[int], salt: str = "") -> int:
        """Start a prompt; returns the leading tokens this stage's prefix cache holds."""
        if seq_id in self.seqs:
            raise ValueError(f"{seq_id}: already open on this stage")
        if not 0 < len(prompt_token_ids) < self.lm.max_model_len:
            raise ValueError(
                f"{seq_id}: a prompt of {len(prompt_token_ids)} tokens does not fit the "
                f"{self.lm.max_model_len}-token context"
            )
        seq = Sequence(seq_id, list(prompt_token_ids), len(prompt_token_ids), SamplingParams())
        self.seqs[seq_id] = seq
        return self.blocks.match_prefix(seq)

    def rewind(self, seq_id: str, num_tokens: int) -> None:
        """Keep only the blocks of the first `num_tokens` (a block multiple): the group
        starts where its least-cached stage does."""
        seq = self.seqs[seq_id]
        if num_tokens % self.config.block_size or num_tokens > seq.num_computed_tokens:
            raise ValueError(f"{seq_id}: cannot rewind to {num_tokens} tokens")
        keep = num_tokens // self.config.block_size
        self.blocks.release(reversed(seq.block_table[keep:]))
        del seq.block_table[keep:], seq.block_hashes[keep:]
        seq.num_computed_tokens = seq.num_cached_tokens = num_tokens

    def run(self, seq_id: str, num_tokens: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt's next `num_tokens` through this stage's layers, their KV written to
        its pool. The first stage takes no `hidden`; every later one takes the stage
        before's output for the same tokens. Returns the residual stream [num_tokens,
        hidden] to hand on, or on the last stage the logits [1, vocab] (fp32) once the
        chunk ends the prompt ([0, vocab] before that)."""
        seq = self.seqs[seq_id]
        if not 0 < num_tokens <= seq.num_uncomputed_tokens:
            raise ValueError(
                f"{seq_id}: {num_tokens} tokens asked, {seq.num_uncomputed_tokens} left"
            )
        if hidden is not None and hidden.shape[0] != num_tokens:
            raise ValueError(f"{seq_id}: {hidden.shape[0]} hidden rows for {num_tokens} tokens")
        if not self.blocks.allocate(seq, num_tokens):
            raise NoRoom(f"{seq_id}: no room for {num_tokens} more tokens on this stage")
        meta, _ = build_batch(
            [ScheduledSeq(seq, num_tokens)], self.config.block_size, self.lm.device
        )
        out = self.model.forward(meta, hidden)
        seq.num_computed_tokens += num_tokens
        self.blocks.commit(seq)  # full blocks join the prefix cache as they complete
        return out

    def export(self, seq_id: str, first_block: int = 0) -> KVExport:
        """This stage's layers of the prompt's KV from `first_block` on (what a streamed
        handoff has not sent yet, or all of it): a slice decode places beside the other
        stages' (handoff.py, fill_reserved_slice)."""
        return export_sequence(
            self.kv,
            self.blocks,
            self.seqs[seq_id],
            self.lm.name,
            self.config.quantization,
            first_block,
        )

    def export_full(self, seq_id: str, first_block: int) -> KVExport | None:
        """The full blocks computed so far from `first_block` on (a streamed chunk), or
        None when there is none new."""
        seq = self.seqs[seq_id]
        return export_full_blocks(self.kv, seq, first_block, self.lm.name, self.config.quantization)

    def run_hop(self, seq_id: str, num_tokens: int, hop: HiddenChunk | None) -> torch.Tensor:
        """run() on a hop from the stage before, checked to be the one this stage needs."""
        if hop is None:
            return self.run(seq_id, num_tokens)
        next_token = self.seqs[seq_id].num_computed_tokens
        hop.check_for(self.lm.name, self.lm.dtype, self.model.first_layer, next_token)
        return self.run(seq_id, num_tokens, hop.data)

    def hop(self, seq_id: str, hidden: torch.Tensor) -> HiddenChunk:
        """run()'s output as the hop to the next stage (the chunk just computed)."""
        first = self.seqs[seq_id].num_computed_tokens - hidden.shape[0]
        return HiddenChunk.of(self.lm.name, hidden, self.model.end_layer, first)

    def block_table(self, seq_id: str) -> list[int]:
        """The pool blocks holding the prompt's KV for this stage's layers, in order."""
        return list(self.seqs[seq_id].block_table)

    def close(self, seq_id: str) -> None:
        """Done with the prompt (handed off, or abandoned): its blocks stay cached by hash
        until evicted."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.blocks.free(seq)
