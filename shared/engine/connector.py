"""Where a request's KV goes once its prompt is done: the engine asks, its worker knows.

As with vLLM's KV connector (vllm/distributed/kv_transfer/kv_connector/v1/base.py), the
engine holds no notion of roles or of where decode runs: a worker that disaggregates gives
the engine a connector, and for each request whose first token exists the engine asks it
whether the KV leaves (then the step's output carries the export and the request ends
here). An engine without a connector (colocated) decodes everything itself. A worker that
streams a long prompt's KV while it is computed says how many blocks decode has already,
and the export leaves them out.
"""

from __future__ import annotations

from typing import Protocol


class KVConnector(Protocol):
    def hands_off(self, request_id: str) -> bool:
        """True: this request's KV leaves after its first token (decode runs elsewhere)."""
        ...

    def streamed_blocks(self, request_id: str) -> int:
        """Leading blocks of this request's KV decode already holds (streamed while the
        prompt was computed): the handoff's export starts after them."""
        ...


class HandOffAll:
    """A prefill-only engine: every request leaves after its first token."""

    def hands_off(self, request_id: str) -> bool:
        return True

    def streamed_blocks(self, request_id: str) -> int:
        return 0
