"""The simulator's model: requests, outcomes and cost presets here; the instances in
cores.py (shared cores), prefill.py and decode.py. Pure bookkeeping, no I/O, no wall clock.

Times are simulated seconds handed in by the event loop (services/tools/sim/run.py). The KV
cache of a prefill instance is the engines' own block pool (shared/engine/block_manager.py,
driven by hash through services/kvmanager/pool.py); the loop mirrors every pool change
into the real KVIndex, as the live KV manager does from instance events.

Modelling choices (the honest simplifications):
- A prefill instance runs one prompt at a time, FIFO. What a prompt reuses is decided when
  it *starts* (its own pool then, plus a pulled prefix if the conductor asked for one and
  the holder still has it), as a live prefill looks up its cache when it runs the job.
  Its duration = transfer of the pulled blocks + cost.prefill_s(new, cached).
  ChunkedPrefillInstance runs the engine's chunked steps instead (the live stack's
  comparison uses it): the same reuse rule, prompts packed into steps of N tokens.
- queue_s shown to the policies = exact remaining time of the running prompt + the
  *predicted* time of the queued ones (their reuse is only known once they start).
- A decode instance runs continuous batching: every step produces one token for each
  sequence in the batch and takes cost.decode_step_s(batch, mean context). A sequence that
  arrives mid-step joins at the next step boundary.
- By default every instance has its own hardware (a cluster's nodes). With `Cores` the
  instances share that many cores, as the engine processes of a one-machine stack do:
  processor sharing, each busy instance running at min(1, cores / busy instances), so a
  prefill or a decode step takes longer exactly while the others are busy too. The rest
  of the machine's work (the gateway, the conductor, the bus) comes with each request and
  runs beside them by its scheduling weight (Cores' background).
- A handoff takes the cost model's line in blocks, or with a measured spread a draw from
  it (seeded: SimConfig.seed); streamed, only the last chunk's blocks (handoff.py).
- A pipelined prefill (SimConfig.max_stages > 1) holds each of its idle instances for
  its stage, from now to the stage's end in the conductor's own flow shop
  (services/conductor/pipeline.py, with the work cost). The group then holds the
  prompt's blocks, split by layers, in a pool of its own, under its holder id in the
  index; the same group reuses them (policy.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from services.conductor.costmodel import CostModel


@dataclass(slots=True)
class SimRequest:
    index: int  # position in the trace
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class Outcome:
    """What happened to one request; times in simulated seconds."""

    request: SimRequest
    rejected: str = ""
    prefill_id: str = ""
    decode_id: str = ""
    predicted_ttft_s: float = 0.0
    reused_blocks: int = 0  # own + pulled, known at prefill start
    stages: int = 0  # prefilled by a pipeline of this many instances (0: by one)
    pulled_blocks: int = 0
    prefill_start_s: float = math.nan
    prefill_end_s: float = math.nan
    ttft_s: float = math.nan
    tbt_s: float = math.nan  # nan when there is no gap (a one-token answer)
    finish_s: float = math.nan

    def hit_tokens(self, block_tokens: int) -> int:
        """docs/design.md's hit: reused leading blocks x block tokens, capped at the input."""
        return min(self.reused_blocks * block_tokens, self.request.input_length)


# ---- cost presets -------------------------------------------------------------------------


def llama3_70b_8xa800() -> CostModel:
    """An approximation of the paper's setting (LLaMA3-70B-like model, one 8xA800 node per
    instance), derived from first principles, not measured:

    - prefill, linear: ~140 GFLOP per token (2 x 70e9 params) at ~1.4 PFLOP/s effective
      (8 x 312 TFLOPS bf16 at ~55% MFU) -> 1.0e-4 s/token.
    - prefill, attention: ~2.6 MFLOP per (query, key) pair (4 x d_model 8192 x 80 layers);
      causal, so n^2/2 pairs among new tokens (-> 1e-9 s x n^2) and n x cached pairs
      against the reused prefix (-> 2e-9 s x n x c). 8k new tokens: ~0.9 s; 16k: ~1.9 s.
    - decode step: ~25 ms floor (140 GB of weights over 8 x 2 TB/s HBM is ~9 ms, plus
      tensor-parallel all-reduces and launches), 0.2 ms per sequence, and KV reads of
      320 KiB per context token (GQA: 80 layers x 8 KV heads x 128 x K,V x bf16) at about
      half of 16 TB/s -> 4e-8 s per batch x context token. Batch 16 at 12k context: ~36 ms.
    - transfer: a 512-token block is 160 MiB; 200 Gbps RDMA (25 GB/s) + 1 ms latency, so
      one block takes ~7 ms and a 24-block prompt ~160 ms.
    """
    return CostModel(
        prefill_coef=[0.02, 1.0e-4, 1.0e-9, 2.0e-9],
        decode_coef=[0.025, 2.0e-4, 4.0e-8],
        transfer_latency_s=0.001,
        transfer_bytes_per_s=25e9,
        overhead_s=0.0,
        block_bytes=512 * 327_680,
        block_size=512,
        # Pipelined prefill: 80 layers; a token's hidden state is 16 KiB in bf16, so a
        # 1,024-token chunk (~0.1 s of one instance's prefill) hops in under 1 ms.
        num_layers=80,
        hidden_bytes_per_token=8192 * 2,
        chunk_tokens=1024,
        source="preset llama3-70b-8xa800 (first-principles approximation)",
    )


PRESETS = {"llama3-70b-8xa800": llama3_70b_8xa800}


def with_block_tokens(cost: CostModel, block_tokens: int) -> CostModel:
    """The same model with `block_tokens`-token blocks (the trace's hashing unit): bytes
    per token are kept, so a fitted model's 16-token block becomes a 512-token one."""
    if cost.block_size == block_tokens:
        return cost
    per_token = cost.block_bytes / cost.block_size
    return replace(cost, block_size=block_tokens, block_bytes=round(per_token * block_tokens))
