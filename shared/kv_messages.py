"""Messages of the KV pool: what the KV manager's index answers, and the copies the
conductor orders of hot prefixes.

The same rules as shared.messages: typed, versioned, and bounded where they are parsed.
"""

from __future__ import annotations

from pydantic import Field

from shared.messages import Count, Hash64, InstanceId, Message, TokenId


class KVMatchRequest(Message):
    block_hashes: list[Hash64]


class KVMatchReply(Message):
    """Longest cached prefix (in blocks) per instance, and of it the blocks past its DRAM
    run, on its disk tier (read back before reuse; never pulled: exports read DRAM).
    `hot_blocks`: the leading run of the asked blocks hit at least the KV manager's
    `--hot-rps` times a second (kvmanager/heat.py), `heat_rps` that run's rate."""

    matches: dict[str, int] = Field(default_factory=dict)
    on_disk: dict[str, int] = Field(default_factory=dict)
    hot_blocks: Count = 0
    heat_rps: float = Field(0.0, ge=0.0, le=1e9)


class KVReplicate(Message):
    """Conductor → a prefill instance, fire and forget: pull this hot prefix from `source`
    ahead of demand and keep it as a replica (evicted before blocks that may be the last
    copy). The tokens let the importer check the blocks' hashes, as any pull does."""

    source: InstanceId
    block_hashes: list[Hash64] = Field(min_length=1)
    token_ids: list[TokenId] = Field(min_length=1)
    tenant: str = Field("", max_length=128)
    heat_rps: float = Field(0.0, ge=0.0, le=1e9)
    blocks: Count = 0
