"""The tokens of an engine step: speculative drafts before it (speculative.py's prompt
lookup), and after it each completing sequence's next token, or the drafts it keeps
(sampling.py). A mixin of LLMEngine, apart so each part stays readable."""

from __future__ import annotations

import torch

from shared.engine.engine_core import EngineCore
from shared.engine.logits import RowContext, TokenLogprobs
from shared.engine.sampling import sample, verify_drafts
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence
from shared.engine.speculative import NgramDrafter, why_not


class StepTokens(EngineCore):
    def _draft(self) -> None:
        """Speculative tokens for each decoding sequence that may have them, while few
        sequences decode (speculative.py)."""
        spec = self.config.speculative
        decoding = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        few = len(decoding) <= spec.disable_by_batch_size
        for seq in decoding:
            seq.draft_token_ids = self._draft_for(seq) if few else []

    def _draft_for(self, seq: Sequence) -> list[int]:
        params, spec = seq.params, self.config.speculative
        k = spec.num_speculative_tokens
        if params.num_speculative_tokens is not None:
            k = params.num_speculative_tokens
        # Room for the drafts and the model's own token after them.
        k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        k = min(k, self.lm.max_model_len - seq.num_tokens - 1)
        if k <= 0 or why_not(params) is not None:
            return []
        req = self.requests[seq.request_id]
        if req.drafter is None:
            req.drafter = NgramDrafter(spec)
        return req.drafter.draft(seq.token_ids, k)

    def _sample(
        self, items: list[ScheduledSeq], logits: torch.Tensor
    ) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
        """Each completing item's tokens (and logprobs, where asked): one sampled from its
        logits row, or, for an item with drafts, those its rows verify."""
        rows, plain, first = [], [], []
        at = 0
        for item in items:
            rows.append(self._row(item.seq))
            first.append(at)
            if not item.draft:
                plain.append(len(rows) - 1)
            at += 1 + len(item.draft)
        tokens: list[list[int]] = [[] for _ in items]
        logprobs: list[TokenLogprobs | None] = [None] * len(items)
        if plain:
            at_rows = [first[i] for i in plain]
            # Every row, in order (a plain decode step): no copy of [rows, vocab] logits.
            whole = at_rows == list(range(logits.shape[0]))
            picked = logits if whole else logits.index_select(0, torch.tensor(at_rows))
            got = sample(picked, [rows[i] for i in plain])
            for i, tok, lp in zip(plain, got.tokens, got.logprobs):
                tokens[i], logprobs[i] = [tok], lp
        for i, item in enumerate(items):
            if item.draft:
                span = logits[first[i] : first[i] + 1 + len(item.draft)]
                tokens[i] = verify_drafts(span, item.draft, rows[i])
        return tokens, logprobs

    def _row(self, seq: Sequence) -> RowContext:
        req = self.requests[seq.request_id]
        stops = frozenset(seq.params.stop_token_ids) | (
            frozenset() if seq.params.ignore_eos else self.lm.eos_token_ids
        )
        return RowContext(
            seq.params,
            seq.num_output_tokens,
            seq.token_ids,
            seq.num_prompt_tokens,
            stops,
            req.matcher,
        )
