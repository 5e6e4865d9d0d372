"""A prefill chunk's SDPA cut at the chunk's first position: its cached prefix, which
every query sees whole, and its own keys, which are plainly causal.

Why: a chunk that starts at position pos0 > 0 needs a mask, and torch's CPU flash
kernel applies an explicit mask to every block of keys, while only the chunk's own last
keys need one. Without a mask the prefix runs at the kernel's full rate; with
`is_causal` the chunk's own keys do. Each part returns its log-sum-exp, so the two merge
exactly: softmax over all keys is the parts' softmaxes weighted by their exp(lse).

Measured, bf16 on an AMX Xeon, 9 query and 3 KV heads of 64, 2 threads, split / masked
time: 256 queries after 768-2,048 cached tokens 0.57-0.79x, 512 after 1,536 0.88x,
512 after 4-8k 0.63x; after a prefix of one or two chunk lengths it loses (1.0-1.2x),
and below 768 cached tokens the two calls' fixed cost does. Hence the rule in `pays`.
"""

from __future__ import annotations

import torch

# The op F.scaled_dot_product_attention runs on CPU; it also returns the log-sum-exp.
# It takes grouped-query K/V (fewer heads than the queries) as SDPA's enable_gqa does.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
MIN_PREFIX = 768
MIN_PREFIX_PER_QUERY = 3


def pays(num_queries: int, pos0: int, device: torch.device) -> bool:
    """Whether a chunk of `num_queries` starting at `pos0` runs faster split."""
    return (
        _FLASH is not None
        and device.type == "cpu"
        and num_queries > 1
        and pos0 >= max(MIN_PREFIX_PER_QUERY * num_queries, MIN_PREFIX)
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, scale: float
) -> torch.Tensor:
    """q [1, Hq, L, D] at positions pos0 .. pos0 + L - 1; k, v [1, Hkv, pos0 + L, D].
    Query j sees keys 0 .. pos0 + j, as with causal_bias."""
    assert _FLASH is not None
    before, lse_before = _FLASH(q, k[:, :, :pos0], v[:, :, :pos0], scale=scale)[:2]
    own, lse_own = _FLASH(q, k[:, :, pos0:], v[:, :, pos0:], is_causal=True, scale=scale)[:2]
    # The prefix's share of the softmax mass: e^a / (e^a + e^b) = sigmoid(a - b).
    share = torch.sigmoid(lse_before - lse_own).unsqueeze(-1).to(q.dtype)
    return torch.lerp(own, before, share)
