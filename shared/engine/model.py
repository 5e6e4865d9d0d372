"""Llama-family forward pass over the paged KV cache (the engine's only tensor math).

Weights come from a transformers model; norms and rotary embeddings are transformers'
own modules, so numerics follow the reference. What differs is the batching: every
scheduled token of every sequence goes through the linear layers as one flat batch;
attention is per sequence against its blocks in the pool: one-token queries (decode)
through the native paged kernel, multi-token chunks (prefill) through SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine import kernels
from shared.engine.kv_cache import KVCache, KVShape


@dataclass
class ChunkMeta:
    """A multi-token query: rows [start, start+n) of the batch, at positions from `pos0`."""

    start: int
    num_tokens: int
    pos0: int
    block_ids: torch.Tensor  # long, the blocks covering pos0 + num_tokens tokens


@dataclass
class BatchMeta:
    """How the flat batch maps onto sequences. Single-token queries come first."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_blocks: torch.Tensor  # [N] long: where each token's K/V goes
    slot_offsets: torch.Tensor  # [N] long
    num_single: int  # rows [0, num_single) are one-token queries
    single_tables: torch.Tensor  # [num_single, max_blocks] int32
    single_ctx: torch.Tensor  # [num_single] int32: tokens each attends to (itself included)
    chunks: list[ChunkMeta]
    logit_rows: torch.Tensor  # [M] long: rows whose next-token logits are needed


class Linear:
    """y = x Wᵀ + b. For bf16 on CPU the weight is prepacked once into oneDNN's blocked
    layout: the plain call repacks it every time, which at decode sizes costs up to half
    of the matmul (same kernel, same results)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.packed: torch.Tensor | None = None
        if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _can_pack():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


class _Layer:
    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        # Fused projections: one GEMM instead of three (and two), same math.
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv = Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                          torch.cat(biases) if all(b is not None for b in biases) else None)
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias)
        self.gate_up = Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down = Linear(mlp.down_proj.weight)


class PagedLlama:
    def __init__(self, hf_model: torch.nn.Module, kv: KVCache) -> None:
        cfg = hf_model.config
        self.config = cfg
        self.kv = kv
        base = hf_model.model
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = Linear(hf_model.lm_head.weight)
        self.layers = [_Layer(layer) for layer in base.layers]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.intermediate = cfg.intermediate_size
        self.scale = self.head_dim ** -0.5
        self.native = kernels.available() and kv.k.device.type == "cpu"
        mlp_act = getattr(cfg, "hidden_act", "silu")
        if mlp_act != "silu":
            raise ValueError(f"unsupported activation {mlp_act!r} (Llama family uses silu)")

    @staticmethod
    def kv_shape(cfg, block_size: int, dtype: torch.dtype) -> KVShape:  # type: ignore[no-untyped-def]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, block_size, dtype)

    @torch.inference_mode()
    def forward(self, meta: BatchMeta) -> torch.Tensor:
        """Logits (fp32) for `meta.logit_rows`, after writing every token's K/V to the pool."""
        h = self.embed(meta.input_ids)
        cos, sin = self.rotary(h, meta.positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, D]
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, layer.input_norm(h), cos, sin, meta)
            x = layer.post_norm(h)
            gate_up = layer.gate_up(x)
            h = h + layer.down(F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:])
        h = self.norm(h.index_select(0, meta.logit_rows))
        return self.lm_head(h).float()

    def _attention(self, i: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        n = x.shape[0]
        qkv = layer.qkv(x)
        hq, hk, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        q = qkv[:, :hq].view(n, self.num_heads, d)
        k = qkv[:, hq:hq + hk].view(n, self.num_kv_heads, d)
        v = qkv[:, hq + hk:].view(n, self.num_kv_heads, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.kv.write(i, meta.slot_blocks, meta.slot_offsets, k, v)
        out = torch.empty(n, self.num_heads, d, dtype=x.dtype, device=x.device)
        if meta.num_single:
            out[:meta.num_single] = self._single(i, q[:meta.num_single], meta)
        for chunk in meta.chunks:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = self._chunk(i, q[rows], chunk)
        return layer.o(out.view(n, hq))

    def _single(self, i: int, q: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if self.native:
            qf = q.float().contiguous()
            res = torch.empty_like(qf)
            kernels.paged_decode_attention(qf, self.kv.k[i], self.kv.v[i], meta.single_tables,
                                           meta.single_ctx, self.scale, res)
            return res.to(q.dtype)
        # Fallback without the native kernel: gather each sequence's blocks.
        rows = []
        for s in range(q.shape[0]):
            ctx = int(meta.single_ctx[s])
            nblocks = -(-ctx // self.kv.shape.block_size)
            ids = meta.single_tables[s, :nblocks].long().to(self.kv.k.device)
            chunk = ChunkMeta(0, 1, ctx - 1, ids)
            rows.append(self._chunk(i, q[s:s + 1], chunk))
        return torch.cat(rows)

    def _chunk(self, i: int, q: torch.Tensor, chunk: ChunkMeta) -> torch.Tensor:
        total = chunk.pos0 + chunk.num_tokens
        k, v = self.kv.gather(i, chunk.block_ids, total)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        kwargs = {"is_causal": True} if chunk.pos0 == 0 else {"attn_mask": _causal_mask(
            chunk.num_tokens, chunk.pos0, q.device)}
        if chunk.num_tokens == 1:
            kwargs = {}
        o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), scale=self.scale,
                                           enable_gqa=True, **kwargs)
        return o[0].transpose(0, 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _causal_mask(num_queries: int, pos0: int, device: torch.device) -> torch.Tensor:
    """Query j (at position pos0 + j) sees keys 0 .. pos0 + j."""
    keys = torch.arange(pos0 + num_queries, device=device)
    queries = torch.arange(pos0, pos0 + num_queries, device=device)
    return keys.unsqueeze(0) <= queries.unsqueeze(1)
