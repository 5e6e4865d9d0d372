"""Messages of decode-side prefix reuse: before a request's KV is offered, prefill asks the
decode instance named for it which leading blocks of the prompt it holds already (an
earlier turn of the same conversation, a sibling sample), and then sends only the rest.

The same rules as shared.messages: typed, versioned, and bounded where they are parsed.
"""

from __future__ import annotations

from pydantic import Field

from shared.messages import Count, GenerateRequest, Message, TokenId


class KVHold(Message):
    """Prefill → decode, request/reply, before any of a request's KV is offered. Decode
    matches the prompt against its own prefix cache, pins the leading blocks it holds (no
    eviction takes them until the handoff comes, is cancelled, or the hold expires) and
    answers with a KVHeld. `whole`: a streamed handoff's opening, which also reserves the
    rest of the prompt's blocks now, or is refused holding nothing; otherwise only the
    prefix is pinned, and the rest is reserved when the handoff is admitted."""

    request: GenerateRequest
    prefill_id: str
    output_token_ids: list[TokenId] = Field(default_factory=list)  # empty for a stream
    num_kv_tokens: Count = Field(gt=0)
    whole: bool = False


class KVHeld(Message):
    """Decode → prefill: the leading blocks of the prompt it has in place and pinned."""

    blocks: Count
