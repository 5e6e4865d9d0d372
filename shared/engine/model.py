"""Llama-family forward pass over the paged KV cache (the engine's only tensor math).

Weights come from a transformers model of a supported family (architectures.py: Llama,
Qwen2, Qwen3, Mistral, Phi-3; what sets each apart is a hook there: QKV biases, per-head
q/k norms, sliding windows, fused checkpoints). Every scheduled token of every sequence goes
through the linear layers as one flat batch; attention is per sequence against its
blocks in the pool, read in place by the native paged kernels: one-token queries (decode,
paged_attention.c) and multi-token chunks (prefill, prefill_attention.c). The torch path
gathers a chunk's KV and runs SDPA; so does the native path for bf16 chunks on a CPU
with AMX tiles, where SDPA is faster (attention_path.py says when).

Two paths compute the same arithmetic (rounding included, see csrc/ops.c):
- native (CPU with the C kernels): per layer, RMSNorm fused with the residual add, the
  QKV GEMM, RoPE fused with the KV write, attention, O, RMSNorm + add, gate/up, SiLU-mul,
  down: nine calls, against some forty eager ops. RoPE reads a cos/sin table built once.
  A decode step of a few rows runs all of that for every layer in one call
  (decode_step.py), since Python between the kernels was a tenth of such a step.
- torch (no compiler, or CUDA): transformers' own norm and rotary modules, eager ops.

A stage of a pipelined prefill runs a contiguous range of the layers over a pool that
holds only their KV (`layers=(first, end)`): the first stage embeds token ids, the others
take the residual stream the stage before handed on; the last ends in logits, the others
hand on the residual stream after their last layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine import architectures, attention_path, fused, kernels, packed
from shared.engine.batch import BatchMeta, ChunkMeta
from shared.engine.decode_step import NativeDecodeStep
from shared.engine.hf_types import HFConfig, causal_lm
from shared.engine.kv_cache import KVCache, KVShape
from shared.engine.linear import Linear
from shared.engine.sdpa import causal_bias, needs_mask, sdpa_chunk

# Rotary variants whose cos/sin depend on the position alone (a table built once holds);
# others (dynamic NTK, longrope) are computed per step.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_MAX_NATIVE_DIM, _MAX_NATIVE_HEAD_DIM = 8192, 256


class PagedModel:
    def __init__(
        self,
        hf_model: torch.nn.Module,
        kv: KVCache,
        quantization: str = "none",
        layers: tuple[int, int] | None = None,
        lean: bool = False,
    ) -> None:
        """`lean`: each projection's weights kept once where the native kernels take every
        row count (the bf16 GEMM), and transformers' copies released layer by layer as
        they are packed, so that loading peaks near one copy of the model. The transformers
        model cannot run after. Without it the engine holds transformers' weights, its
        fused copies and two packings (the GEMV's or GEMM's, and oneDNN's)."""
        hf = causal_lm(hf_model)
        cfg = hf.config
        self.config = cfg
        self.family = architectures.family(cfg)  # UnsupportedModel for any other
        self.first_layer, self.end_layer = layer_range(cfg, layers)
        if kv.shape.num_layers != self.end_layer - self.first_layer:
            raise ValueError(
                f"a pool of {kv.shape.num_layers} layers for layers "
                f"[{self.first_layer}, {self.end_layer})"
            )
        self.kv = kv
        self.quantization = quantization
        base = hf.model
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head: Linear | None = None  # a stage before the last has no head
        if self.end_layer == cfg.num_hidden_layers:
            self.lm_head = packed.head(hf_model, quantization, lean)
        self.layers = packed.layers(hf_model, self.first_layer, self.end_layer, quantization, lean)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = _head_dim(cfg)
        self.intermediate = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.dtype = self.embed.weight.dtype
        self.native = (
            kernels.available()
            and kv.k.device.type == "cpu"
            and cfg.hidden_size <= _MAX_NATIVE_DIM
            and self.head_dim <= _MAX_NATIVE_HEAD_DIM
        )
        # Chunks of at least this many queries attend through SDPA (None: never).
        self.sdpa_min_chunk = attention_path.for_model(self.dtype)
        # Causal masks by (queries, pos0, window), shared by every layer of one forward.
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step: NativeDecodeStep | bool | None = None  # False: not for this model

    @staticmethod
    def kv_shape(
        cfg: HFConfig, block_size: int, dtype: torch.dtype, layers: tuple[int, int] | None = None
    ) -> KVShape:
        first, end = layer_range(cfg, layers)
        return KVShape(
            end - first,
            cfg.num_key_value_heads,
            _head_dim(cfg),
            block_size,
            dtype,
            first,
            architectures.family(cfg).architecture,
        )

    @property
    def is_first(self) -> bool:
        """Embeds token ids (else takes the residual stream from the stage before)."""
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        """Ends in logits (else hands on the residual stream)."""
        return self.end_layer == self.config.num_hidden_layers

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights one decode step reads (every linear layer; embeddings are a
        gather of a few rows)."""
        head = self.lm_head.nbytes if self.lm_head is not None else 0
        return sum(lin.nbytes for layer in self.layers for lin in layer.linears) + head

    @torch.inference_mode()
    def forward(self, meta: BatchMeta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (fp32) for `meta.logit_rows`, after writing every token's K/V to the pool.
        A stage before the last returns the residual stream [N, hidden] instead, and a
        stage after the first takes the one before's as `hidden` (it is not changed)."""
        if self.is_first == (hidden is not None):
            raise ValueError("the first stage takes token ids, every later one hidden states")
        if hidden is None:
            h = self.embed(meta.input_ids)
        else:  # the stage before's rows may come from another device or over the wire
            h = hidden.to(device=self.embed.weight.device, dtype=self.dtype, copy=True)
        try:
            if self.native:
                return self._forward_native(h, meta)
            return self._forward_torch(h, meta)
        finally:
            self._masks.clear()  # a 32k context's is tens of MB

    # -- native path ----------------------------------------------------------------------
    def _forward_native(self, h: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        cos, sin, positions = self._rope(h, meta.positions)
        step = self._decode_step(cos, sin)
        if step is not None and step.fits(meta):
            delta = step(h, positions, meta)  # every layer in one native call
        else:
            delta = self._layers_native(h, cos, sin, positions, meta)
        if not self.is_last:
            return h.add_(delta)  # rounded to the dtype as the next layer's fused add does
        rows = meta.logit_rows
        x = fused.rms_norm(
            h.index_select(0, rows), delta.index_select(0, rows), self.norm.weight, self.eps
        )
        return self._head()(x).float()

    def _head(self) -> Linear:
        assert self.lm_head is not None, "logits asked of a stage before the last"
        return self.lm_head

    def _decode_step(self, cos: torch.Tensor, sin: torch.Tensor) -> NativeDecodeStep | None:
        """The one-call decode step, where the shapes allow it and the RoPE table is fixed."""
        if self._step is None:
            whole = self.is_first and self.is_last  # a stage only prefills
            static = whole and cos is (self._rope_table or (None,))[0]
            self._step = (
                NativeDecodeStep(self, cos, sin)
                if static and NativeDecodeStep.supports(self)
                else False
            )
        return self._step if isinstance(self._step, NativeDecodeStep) else None

    def _layers_native(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        meta: BatchMeta,
    ) -> torch.Tensor:
        """The layers op by op (prefill chunks, bigger batches); returns the last MLP output."""
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x = fused.rms_norm(h, delta, layer.input_norm.weight, self.eps)
            qkv = layer.qkv(x)
            if layer.q_norm is not None and layer.k_norm is not None:
                fused.head_rms_norm(
                    qkv,
                    self.num_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    layer.q_norm.weight,
                    layer.k_norm.weight,
                    self.eps,
                )
            fused.rope_kv_write(
                qkv,
                cos,
                sin,
                positions,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                meta.slot_blocks,
                meta.slot_offsets,
                self.kv.k[i],
                self.kv.v[i],
            )
            x = fused.rms_norm(
                h, layer.o(self._attend(i, qkv, meta)), layer.post_norm.weight, self.eps
            )
            delta = layer.down(fused.silu_mul(layer.gate_up(x)))
        assert delta is not None
        return delta

    def _rope(
        self, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 cos/sin tables (rounded to the activation dtype first, as transformers
        casts them) and the row of each token in them."""
        if getattr(self.rotary, "rope_type", "default") not in _STATIC_ROPE:
            cos, sin = self.rotary(h, positions.unsqueeze(0))
            return (
                cos[0].float().contiguous(),
                sin[0].float().contiguous(),
                torch.arange(h.shape[0], dtype=torch.long),
            )
        if self._rope_table is None:
            n = int(self.config.max_position_embeddings)
            all_pos = torch.arange(n, dtype=torch.long).unsqueeze(0)
            cos, sin = self.rotary(h[:1].expand(n, -1), all_pos)
            self._rope_table = cos[0].float().contiguous(), sin[0].float().contiguous()
        return self._rope_table[0], self._rope_table[1], positions

    def _attend(self, i: int, qkv: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        n, hq = qkv.shape[0], self.num_heads * self.head_dim
        window = self.layers[i].window
        out = torch.empty(n, hq, dtype=qkv.dtype)
        if meta.num_single:
            kernels.paged_decode_attention(
                qkv[: meta.num_single],
                self.kv.k[i],
                self.kv.v[i],
                meta.single_tables,
                meta.single_ctx,
                self.scale,
                out[: meta.num_single],
                window,
            )
        least = self.sdpa_min_chunk
        for chunk in meta.chunks:  # each chunk against its sequence's KV in place
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            if least is not None and chunk.num_tokens >= least:
                # qkv holds the rotated queries and the KV is in the pool already.
                q = qkv[rows, :hq].view(chunk.num_tokens, self.num_heads, self.head_dim)
                out[rows] = self._chunk(i, q, chunk).reshape(chunk.num_tokens, hq)
                continue
            kernels.paged_prefill_attention(
                qkv[rows],
                self.kv.k[i],
                self.kv.v[i],
                chunk.block_ids.to(torch.int32),
                chunk.pos0,
                self.scale,
                out[rows],
                window,
            )
        return out

    # -- torch path -----------------------------------------------------------------------
    def _forward_torch(self, h: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        cos, sin = self.rotary(h, meta.positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, D]
        for i, layer in enumerate(self.layers):
            h = h + self._attention_torch(i, layer, layer.input_norm(h), cos, sin, meta)
            x = layer.post_norm(h)
            gate_up = layer.gate_up(x)
            h = h + layer.down(
                F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
            )
        if not self.is_last:
            return h
        h = self.norm(h.index_select(0, meta.logit_rows))
        return self._head()(h).float()

    def _attention_torch(
        self,
        i: int,
        layer: packed.PackedLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMeta,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = layer.qkv(x)
        hq, hk, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        q = qkv[:, :hq].view(n, self.num_heads, d)
        k = qkv[:, hq : hq + hk].view(n, self.num_kv_heads, d)
        v = qkv[:, hq + hk :].view(n, self.num_kv_heads, d)
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3, before RoPE
            q, k = layer.q_norm(q), layer.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.kv.write(i, meta.slot_blocks, meta.slot_offsets, k, v)
        out = torch.empty(n, self.num_heads, d, dtype=x.dtype, device=x.device)
        if meta.num_single:
            out[: meta.num_single] = self._single_torch(i, q[: meta.num_single], meta)
        for chunk in meta.chunks:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = self._chunk(i, q[rows], chunk)
        return layer.o(out.view(n, hq))

    def _single_torch(self, i: int, q: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        """One-token queries without the native kernel: gather each sequence's blocks."""
        rows = []
        for s in range(q.shape[0]):
            ctx = int(meta.single_ctx[s])
            nblocks = -(-ctx // self.kv.shape.block_size)
            ids = meta.single_tables[s, :nblocks].long().to(self.kv.k.device)
            rows.append(self._chunk(i, q[s : s + 1], ChunkMeta(0, 1, ctx - 1, ids)))
        return torch.cat(rows)

    # -- the torch path's attention ------------------------------------------------------
    def _chunk(self, i: int, q: torch.Tensor, chunk: ChunkMeta) -> torch.Tensor:
        mask = None
        window = self.layers[i].window
        if needs_mask(chunk, window, q.device):
            # The same mask for every layer alike: build it once per forward pass.
            key = (chunk.num_tokens, chunk.pos0, window)
            mask = self._masks.get(key)
            if mask is None:
                mask = self._masks[key] = causal_bias(*key[:2], q.dtype, q.device, window)
        return sdpa_chunk(self.kv, i, q, chunk, self.scale, mask, window)


def layer_range(cfg: HFConfig, layers: tuple[int, int] | None) -> tuple[int, int]:
    """[first, end) of the model's layers (None: all of them), or ValueError."""
    total = int(cfg.num_hidden_layers)
    first, end = layers or (0, total)
    if not 0 <= first < end <= total:
        raise ValueError(f"layers [{first}, {end}) is not a range within the model's {total}")
    return first, end


def _head_dim(cfg: HFConfig) -> int:
    """Some configs name it; others imply it (hidden size over heads)."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
