"""A streamed handoff, prefill's side (pure bookkeeping): which prompts send their KV to
decode chunk by chunk while they are computed, and how far each one has got.

Mooncake's prefill moves KV while it computes it, so the handoff after the last chunk
adds almost nothing. Here the unit is a prefill step: after each step of a long prompt its
new full blocks go to the decode instance named in its job, beside the next step, and
when the first token exists only the blocks decode has not acked go with it. A prompt of
one chunk gains nothing from this and is handed off whole, as before.

Anything that goes wrong (decode refuses the first chunk for want of room, a chunk fails)
only ends the stream: `acked` stays what decode holds, and the handoff after the first
token carries the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import GenerateRequest


@dataclass
class Outgoing:
    decode_id: str
    request: GenerateRequest
    acked: int = 0  # leading blocks decode has in place, acked chunk by chunk
    opened: bool = False  # decode reserved the prompt's blocks (it acked the first chunk)
    busy: bool = False  # a chunk is on its way: the next one waits, and then covers more
    stopped: bool = False  # refused or failed: the rest goes with the first token

    def ready(self) -> bool:
        return not (self.busy or self.stopped)


def worth_streaming(request: GenerateRequest, chunk_tokens: int) -> bool:
    return streams(len(request.prompt_token_ids), request.sampling.max_tokens, chunk_tokens)


def streams(prompt_tokens: int, max_tokens: int, chunk_tokens: int) -> bool:
    """More than one prefill chunk, and a request that goes on after its first token (one
    that ends at prefill would leave decode a reservation for nothing). The simulator asks
    this too."""
    return prompt_tokens > chunk_tokens and max_tokens > 1
