"""KV that crosses instances: a prefilled request handed to decode (whole, or reserved
first and streamed in), and prefix blocks pulled from a peer's cache or exported to one.

Every method here keeps the engine's concurrency contract (llm_engine.py): the importer
and exporter threads may call them at any time, as each holds the bookkeeping lock while
it changes the pool or the queues.
"""

from __future__ import annotations

from shared.engine.engine_core import EngineCore
from shared.engine.engine_types import continuation
from shared.engine.kv_slices import SliceProgress
from shared.engine.kv_transfer import (
    KVExport,
    check_compatible,
    export_cached,
    export_full_blocks,
    fill_sequence,
    fill_slice,
    import_sequence,
)
from shared.engine.params import SamplingParams
from shared.engine.sequence import Sequence
from shared.hashing import block_hashes


class KVHandoff(EngineCore):
    """The engine's import and export side (LLMEngine adds the steps)."""

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        kv: KVExport,
        emitted_text: str = "",
        salt: str = "",
    ) -> bool:
        """Continue a request prefilled elsewhere; False if the pool has no room yet."""
        self.check_fits(prompt_token_ids, params, output_token_ids)
        self.check_kv(kv.meta)
        seq = continuation(request_id, prompt_token_ids, output_token_ids, params, salt)
        with self.book:
            if seq.request_id in self.requests:
                raise ValueError(f"duplicate request id {seq.request_id}")
            if not import_sequence(self.kv, self.blocks, seq, kv, on_allocate=self.tier.spill):
                return False
            self.register(seq, output_token_ids, emitted_text)
            self.scheduler.add_running(seq)
        return True

    # -- decode admission: KV slots reserved before a transfer starts ---------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        num_kv_tokens: int,
        salt: str = "",
    ) -> bool:
        """Hold pool blocks for a request's KV before fetching it (as SGLang's decode
        prealloc queue does); False, holding no more than before, if the pool has no room
        now. Full blocks of the prompt this pool already caches (a sibling sample's, an
        earlier turn's) are shared, not fetched again into new ones; a prefix pinned by
        hold_prefix stays, and only the rest is reserved."""
        self.check_fits(prompt_token_ids, params, output_token_ids)
        seq = continuation(request_id, prompt_token_ids, output_token_ids, params, salt)
        with self.book:
            return self._reserve(seq, num_kv_tokens) is not None

    def hold_prefix(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        num_kv_tokens: int,
        salt: str = "",
        whole: bool = False,
    ) -> int | None:
        """Pin the leading full blocks of the prompt this pool caches, so that a handoff
        need bring only the rest (SGLang's decode-side radix cache); returns how many.
        Nothing more is allocated: reserve takes the rest when the handoff is admitted,
        and release gives the pin back. With `whole` the rest is reserved now too (a
        streamed handoff's opening): None, holding nothing, if the pool has no room."""
        self.check_fits(prompt_token_ids, params, output_token_ids)
        seq = continuation(request_id, prompt_token_ids, output_token_ids, params, salt)
        with self.book:
            if whole:
                reserved = self._reserve(seq, num_kv_tokens)
                return None if reserved is None else len(reserved.block_hashes)
            self._check_new(request_id)
            if request_id not in self.held:
                self._matched(seq, num_kv_tokens)
                if not seq.block_table:
                    return 0
                self.held[request_id] = seq
            return len(self.held[request_id].block_table)

    def _check_new(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.reserved:
            raise ValueError(f"duplicate request id {request_id}")

    def _reserve(self, seq: Sequence, num_kv_tokens: int) -> Sequence | None:
        """reserve's work (the caller holds the lock): the reserved sequence (the held one
        if its prefix was pinned), or None."""
        rid = seq.request_id
        self._check_new(rid)
        held = self.held.pop(rid, None)
        if held is not None:
            seq = held
        else:
            self._matched(seq, num_kv_tokens)
        if not self.blocks.allocate(seq, num_kv_tokens - seq.num_computed_tokens):
            if held is not None:
                self.held[rid] = held  # still pinned for the next try
            else:
                self.blocks.free(seq)
            return None
        self.tier.spill()  # what the allocation evicted goes to disk before it is overwritten
        self.reserved[rid] = seq
        return seq

    def _matched(self, seq: Sequence, num_kv_tokens: int) -> None:
        """Attach the cached blocks of `seq`'s prefix, never past the KV that will come
        (the caller holds the lock)."""
        if not 0 < num_kv_tokens <= seq.num_tokens:
            raise ValueError(f"KV of {num_kv_tokens} tokens for a sequence of {seq.num_tokens}")
        self.blocks.match_prefix(seq)
        if seq.num_computed_tokens > num_kv_tokens:
            self.blocks.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0

    def fill_reserved(self, request_id: str, kv: KVExport) -> int:
        """Write a streamed chunk of a reserved request's KV into its blocks (the request
        stays reserved until add_reserved brings the rest); returns the blocks in place.
        On a bad chunk the reservation is kept: the rest may still come whole."""
        self.check_kv(kv.meta)
        with self.book:
            seq = self.reserved.get(request_id)
            if seq is None:
                raise ValueError(f"request {request_id} has no reservation")
            fill_sequence(self.kv, self.blocks, seq, kv)
            return seq.num_computed_tokens // self.config.block_size

    def add_reserved(
        self, request_id: str, kv: KVExport, output_token_ids: list[int], emitted_text: str = ""
    ) -> None:
        """Continue a reserved request with its fetched KV (all of it, or what a stream
        left): written into its blocks, then into the running batch. A reservation made
        before the first token existed (a stream's) takes the tokens now. On a bad payload
        its blocks go back to the pool."""
        self.check_kv(kv.meta)
        with self.book:
            seq = self.reserved.pop(request_id, None)
            if seq is None:
                raise ValueError(f"request {request_id} has no reservation")
            if seq.num_output_tokens == 0:
                seq.token_ids.extend(output_token_ids)
            try:
                fill_sequence(self.kv, self.blocks, seq, kv)
            except ValueError:
                self.blocks.free(seq)
                raise
            self.register(seq, output_token_ids, emitted_text)
            self.scheduler.add_running(seq)

    # -- a pipelined prefill's KV: each stage's layers, arriving on their own --------------
    def fill_reserved_slice(self, request_id: str, kv: KVExport) -> int:
        """Write one stage's slice (some layers of some blocks) of a reserved request's KV;
        returns the leading blocks now whole in every layer."""
        check_compatible(kv.meta, self.kv, self.lm.name, self.config.quantization, True)
        with self.book:
            seq = self.reserved.get(request_id)
            if seq is None:
                raise ValueError(f"request {request_id} has no reservation")
            progress = self.slices.setdefault(request_id, SliceProgress(self.kv.shape.num_layers))
            return fill_slice(self.kv, self.blocks, seq, kv, progress)

    def add_reserved_slices(
        self, request_id: str, output_token_ids: list[int], emitted_text: str = ""
    ) -> None:
        """Continue a reserved request whose KV came in slices, once every layer of every
        block it reserved is in place (ValueError otherwise; the reservation is kept)."""
        with self.book:
            seq = self.reserved.get(request_id)
            if seq is None:
                raise ValueError(f"request {request_id} has no reservation")
            # Every token's KV but the last one's (the next step computes that).
            outputs = seq.num_output_tokens or len(output_token_ids)
            needed = seq.num_prompt_tokens + max(0, outputs - 1)
            if seq.num_computed_tokens < needed:
                raise ValueError(
                    f"request {request_id}: KV of {seq.num_computed_tokens} of {needed} "
                    "tokens in every layer"
                )
            del self.reserved[request_id]
            self.slices.pop(request_id, None)
            if seq.num_output_tokens == 0:
                seq.token_ids.extend(output_token_ids)
            self.register(seq, output_token_ids, emitted_text)
            self.scheduler.add_running(seq)

    def release(self, request_id: str) -> bool:
        """Give back a reservation or a held prefix (cancelled, or its transfer failed)."""
        with self.book:
            self.slices.pop(request_id, None)
            seq = self.reserved.pop(request_id, None) or self.held.pop(request_id, None)
            if seq is None:
                return False
            self.blocks.free(seq)
        return True

    # -- prefix blocks between instances --------------------------------------------------
    def export_prefix(self, hashes: list[int]) -> KVExport | None:
        """Cached blocks of a prefix, for an instance that wants to reuse them. Safe from any
        thread: it looks up and copies under the bookkeeping lock (see the module doc)."""
        with self.book:
            return export_cached(
                self.kv, self.blocks, hashes, self.lm.name, self.config.quantization
            )

    def export_streamable(self, request_id: str, first_block: int) -> KVExport | None:
        """The full blocks a prompt still in prefill has computed from `first_block` on
        (a streamed handoff's next chunk), or None: none new, or the prompt is done or gone.
        Safe from any thread, as export_prefix is."""
        with self.book:
            req = self.requests.get(request_id)
            if req is None or req.seq.num_output_tokens > 0:
                return None
            return export_full_blocks(
                self.kv, req.seq, first_block, self.lm.name, self.config.quantization
            )

    def import_prefix(
        self, token_ids: list[int], export: KVExport, salt: str = "", replica: bool = False
    ) -> int:
        """Add pulled prefix blocks to this pool's prefix cache; returns the tokens they cover.

        The hashes must be those of `token_ids` (same tokens, same tenant): blocks from
        elsewhere are never trusted blindly. 0 when the pool has no room right now.
        `replica`: a hot prefix's copy (conductor/replication.py); the blocks it adds are
        evicted before the pool's others.
        """
        self.check_kv(export.meta)
        n_tokens = export.meta.num_blocks * self.config.block_size
        expected = block_hashes(token_ids[:n_tokens], self.config.block_size, salt)
        if export.meta.block_hashes != expected or len(expected) != export.meta.num_blocks:
            raise ValueError("pulled KV blocks do not match this prompt's prefix hashes")
        seq = Sequence(
            f"import:{expected[-1]:x}",
            list(token_ids[:n_tokens]),
            n_tokens,
            SamplingParams(max_tokens=1),
            salt,
        )
        with self.book:  # the allocation may evict a block an export is about to copy
            had = len(self.blocks.cached_chain(expected))
            if not import_sequence(self.kv, self.blocks, seq, export, on_allocate=self.tier.spill):
                return 0
            self.blocks.free(seq)  # unreferenced but cached: the next match_prefix finds them
            if replica:
                self.blocks.mark_replicas(expected[had:])
        return n_tokens
