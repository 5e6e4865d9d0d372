"""The KV pool's tensors: every layer's K and V blocks, preallocated from a byte budget.

Layouts, per layer (see csrc/paged_attention.c for why K is transposed in a block):
    k  [num_blocks, num_kv_heads, head_dim, block_size]
    v  [num_blocks, num_kv_heads, block_size, head_dim]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int  # the layers this pool holds: first_layer .. first_layer + num_layers
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    first_layer: int = 0  # a pipeline stage's pool starts at its first layer
    # The model class whose KV this is (architectures.py): KV of one family is not
    # another's even where the shapes agree.
    architecture: str = "LlamaForCausalLM"

    @property
    def block_nbytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * self.block_size
        return self.num_layers * per_layer * self.dtype.itemsize

    def num_blocks_for(self, nbytes: int) -> int:
        return max(1, nbytes // self.block_nbytes)


class KVCache:
    def __init__(self, shape: KVShape, num_blocks: int, device: str = "cpu") -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        s = shape
        # One tensor each for K and V: a block's bytes for every layer are one index away.
        self.k = torch.zeros(
            s.num_layers,
            num_blocks,
            s.num_kv_heads,
            s.head_dim,
            s.block_size,
            dtype=s.dtype,
            device=device,
        )
        self.v = torch.zeros(
            s.num_layers,
            num_blocks,
            s.num_kv_heads,
            s.block_size,
            s.head_dim,
            dtype=s.dtype,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new tokens' K/V ([N, heads, dim]) at (block, offset) slots."""
        # Advanced indices split by a slice put the indexed dim first: [N, heads, dim].
        self.k[layer][blocks, :, :, offsets] = k
        self.v[layer][blocks, :, offsets, :] = v

    def gather(
        self, layer: int, block_ids: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V as dense [heads, tokens, dim] (a copy; for prefill chunks)."""
        s = self.shape
        k = self.k[layer].index_select(0, block_ids)  # [n, H, D, B]
        v = self.v[layer].index_select(0, block_ids)  # [n, H, B, D]
        k = k.permute(1, 0, 3, 2).reshape(s.num_kv_heads, -1, s.head_dim)[:, :num_tokens]
        v = v.permute(1, 0, 2, 3).reshape(s.num_kv_heads, -1, s.head_dim)[:, :num_tokens]
        return k, v

    def block_data(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block's K and V over all layers (copies, on CPU)."""
        return self.k[:, block_id].cpu().clone(), self.v[:, block_id].cpu().clone()

    def write_block(self, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[:, block_id] = k.to(self.k.device)
        self.v[:, block_id] = v.to(self.v.device)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Blocks as one contiguous tensor [2, layers, n, ...] in pool layout (for transfer)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        k = self.k.index_select(1, idx).contiguous().view(-1)
        v = self.v.index_select(1, idx).contiguous().view(-1)
        return torch.cat([k, v]).cpu()

    def import_blocks(
        self,
        block_ids: list[int],
        data: torch.Tensor,
        skip: int = 0,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Write blocks exported by export_blocks into `block_ids`, leaving out the first
        `skip` blocks of the payload (ones this pool already holds). `layers`: the payload
        holds only these of the pool's layers (a pipeline stage's slice; default: all)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        s, n = self.shape, len(block_ids) + skip
        first, end = layers or (0, s.num_layers)
        nl, half = end - first, data.numel() // 2
        k = data[:half].view(nl, n, s.num_kv_heads, s.head_dim, s.block_size)[:, skip:]
        v = data[half:].view(nl, n, s.num_kv_heads, s.block_size, s.head_dim)[:, skip:]
        self.k[first:end].index_copy_(1, idx, k.to(self.k.device))
        self.v[first:end].index_copy_(1, idx, v.to(self.v.device))
