"""The native kernels against torch's own ops, on random data (no model needed).

Whatever CPU runs them (and whatever HALFMOON_CPU_ISA caps it to), each kernel must give
torch's results: fp32 to rounding, bf16 as torch rounds it, int8 weights as their
dequantized values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.engine import fused, kernels
from shared.engine.linear import DenseLinear, Int8Linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler here")


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 12, 13, 37])
def test_dense_linear_matches_torch(dtype, rows):
    w, b = rand(192, 128, dtype=dtype), rand(192, seed=1)
    x = rand(rows, 128, dtype=dtype, seed=2)
    lin = DenseLinear(w, b.to(dtype))
    # the native GEMM wherever the CPU has it: bf16 with AVX512_BF16, fp32 with AVX2
    has = (
        kernels.lib().gemm_bf16_available
        if dtype == torch.bfloat16
        else kernels.lib().gemm_f32_available
    )
    assert lin.gemm == bool(has())
    got = lin(x).float()
    ref = x.float() @ w.float().t() + b.to(dtype).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 24])
def test_int8_linear_is_the_dequantized_weights_at_any_row_count(dtype, rows):
    """The GEMV (up to 8 rows) and the dense path (more) both compute with the int8 grid's
    weights: x (q * s)^T, the activations at their own precision."""
    w = rand(256, 192)
    lin = Int8Linear(w.to(dtype))
    x = rand(rows, 192, dtype=dtype, seed=3)
    ref = x.float() @ lin.dequantized.float().t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lin(x).float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    # every weight within half a step of the int8 grid (plus bf16's own rounding)
    step = lin.scales[:, None]
    assert ((lin.dequantized.float() - w.to(dtype).float()).abs() <= 0.51 * step + 1e-2).all()


@pytest.mark.parametrize("make", [DenseLinear, Int8Linear], ids=["dense", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(make, dtype):
    """The GEMV sums a full tile of rows together (one transposed reduction) and a
    partial one row by row, and the GEMM tiles rows by the dozen or half-dozen: each must
    round alike, or a sequence's tokens would depend on how many others share its step."""
    lin = make(rand(256, 192, dtype=dtype, seed=4))
    rows = min(lin.gemv_rows, 13)
    if rows < 4:
        pytest.skip("no native tile of 4 rows for this weight on this CPU")
    x = rand(rows, 192, dtype=dtype, seed=5)
    together = lin(x)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = rand(96, seed=4).abs()
    norm = norm.to(dtype)
    h, delta = rand(7, 96, dtype=dtype, seed=5), rand(7, 96, dtype=dtype, seed=6)
    ref_h = h + delta
    ref = norm(ref_h)
    got = fused.rms_norm(h, delta, norm.weight, 1e-5)
    assert torch.equal(h, ref_h)  # the residual add happened in place, rounded the same
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gu = rand(3, 2 * 80, dtype=dtype, seed=7) * 4
    ref = F.silu(gu[:, :80]) * gu[:, 80:]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(fused.silu_mul(gu).float(), ref.float(), atol=tol, rtol=tol)


def test_rope_kv_write_rotates_and_writes_slots():
    hq, hk, d, bs = 6, 2, 16, 4
    qkv = rand(5, (hq + 2 * hk) * d, seed=8)
    positions = torch.tensor([0, 3, 7, 8, 20])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(32).float(), inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    k_cache, v_cache = torch.zeros(6, hk, d, bs), torch.zeros(6, hk, bs, d)
    blocks, offsets = torch.tensor([0, 0, 1, 2, 5]), torch.tensor([0, 3, 3, 0, 0])
    ref = qkv.clone()
    fused.rope_kv_write(qkv, cos, sin, positions, hq, hk, d, blocks, offsets, k_cache, v_cache)

    def rot(x, p):
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos[p] + torch.cat([-x2, x1], -1) * sin[p]

    for r, p in enumerate(positions.tolist()):
        q = ref[r, : hq * d].view(hq, d)
        k = ref[r, hq * d : (hq + hk) * d].view(hk, d)
        v = ref[r, (hq + hk) * d :].view(hk, d)
        assert torch.allclose(qkv[r, : hq * d].view(hq, d), rot(q, p), atol=1e-6)
        assert torch.allclose(k_cache[blocks[r], :, :, offsets[r]], rot(k, p), atol=1e-6)
        assert torch.equal(v_cache[blocks[r], :, offsets[r], :], v)


# Query heads, KV heads, head dim: the default model's shape, and each group size and
# head dim the AVX-512 kernels have a specialization for (the rest take the plain C path).
SHAPES = [(9, 3, 64), (8, 2, 64), (4, 2, 64), (4, 4, 64), (4, 2, 128), (2, 2, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs,ctx", [(1, 1), (1, 700), (2, 45), (5, 300)])
@pytest.mark.parametrize("hq,hk,d", SHAPES)
def test_paged_attention_matches_sdpa(dtype, seqs, ctx, hq, hk, d):
    """One query per sequence against its scattered blocks; with one or two sequences and a
    long context the kernel splits the context over threads and merges the parts."""
    bs, nblocks = 16, 200
    k_cache, v_cache = (
        rand(nblocks, hk, d, bs, dtype=dtype, seed=9),
        rand(nblocks, hk, bs, d, dtype=dtype, seed=10),
    )
    lens = [ctx - 7 * s if ctx - 7 * s > 0 else ctx for s in range(seqs)]
    width = -(-max(lens) // bs)
    gen = torch.Generator().manual_seed(11)
    tables = torch.stack(
        [torch.randperm(nblocks, generator=gen)[:width] for _ in range(seqs)]
    ).int()
    q = rand(seqs, (hq + 2 * hk) * d, dtype=dtype, seed=12)  # rows of a qkv buffer
    out = torch.empty(seqs, hq * d, dtype=dtype)
    kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), d**-0.5, out
    )
    for s, n in enumerate(lens):
        ids = tables[s, : -(-n // bs)].long()
        k = k_cache[ids].permute(1, 0, 3, 2).reshape(hk, -1, d)[:, :n].float()
        v = v_cache[ids].permute(1, 0, 2, 3).reshape(hk, -1, d)[:, :n].float()
        qs = q[s, : hq * d].float().view(hq, 1, d)
        ref = F.scaled_dot_product_attention(
            qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True
        )[0].reshape(hq * d)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out[s].float(), ref, atol=tol, rtol=tol), (s, n)


def _chunk_reference(q, k, v, table, pos0, scale, window=0):
    """SDPA of a chunk (query i at position pos0 + i) against the sequence's gathered KV,
    with transformers' sliding-window mask where `window` is set."""
    n, hq, d = q.shape
    total = pos0 + n
    nb = -(-total // k.shape[3])
    ids = table[:nb].long()
    kk = k.index_select(0, ids).permute(1, 0, 3, 2).reshape(k.shape[1], -1, d)[:, :total]
    vv = v.index_select(0, ids).permute(1, 0, 2, 3).reshape(k.shape[1], -1, d)[:, :total]
    keys, queries = torch.arange(total), torch.arange(pos0, total)
    mask = keys.unsqueeze(0) <= queries.unsqueeze(1)
    if window:
        mask &= keys.unsqueeze(0) > queries.unsqueeze(1) - window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).float(),
        kk.unsqueeze(0).float(),
        vv.unsqueeze(0).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).reshape(n, hq * d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hq,hkv,d,bs,n,pos0",
    [
        (9, 3, 64, 16, 512, 0),  # the default model's shape, a first chunk
        (9, 3, 64, 16, 100, 1000),  # a later chunk
        (9, 3, 64, 16, 200, 30),  # more rows than one tile
        (8, 2, 32, 16, 37, 5),
        (12, 4, 128, 16, 33, 17),  # two 64-wide slices of the head
        (6, 2, 16, 16, 64, 300),
        (4, 4, 48, 8, 20, 3),  # 8-token blocks: the plain C path
        (6, 2, 20, 16, 9, 40),  # a head not a multiple of the vector width
        (2, 1, 64, 16, 1, 0),  # a one-token chunk
    ],
)
def test_paged_prefill_attention_matches_sdpa(dtype, hq, hkv, d, bs, n, pos0):
    torch.manual_seed(hq * 1000 + n)
    nb = -(-(pos0 + n) // bs) + 3  # spare blocks, and the table shuffled: read in place
    k = torch.randn(nb, hkv, d, bs).to(dtype)
    v = torch.randn(nb, hkv, bs, d).to(dtype)
    table = torch.randperm(nb).to(torch.int32)
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)  # q is the head of each qkv row
    out = torch.empty(n, hq * d, dtype=dtype)
    kernels.paged_prefill_attention(qkv, k, v, table, pos0, d**-0.5, out)
    want = _chunk_reference(qkv[:, : hq * d].reshape(n, hq, d), k, v, table, pos0, d**-0.5)
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("spread", [0.01, 8.0, 40.0])
def test_paged_prefill_attention_rescales_on_wide_scores(spread):
    """The AVX2 softmax moves a row's running max only when a score passes it by 8 or
    more: scores far apart (and rising along the keys, so the max moves block after
    block) must still give SDPA's answer."""
    torch.manual_seed(int(spread * 10))
    hq, hkv, d, bs, n, pos0 = 9, 3, 64, 16, 70, 300
    nb = -(-(pos0 + n) // bs)
    ramp = torch.linspace(0, 1, nb * bs).view(nb, 1, 1, bs)  # later keys score higher
    k = torch.randn(nb, hkv, d, bs) + ramp * spread
    v = torch.randn(nb, hkv, bs, d)
    table = torch.randperm(nb).to(torch.int32)
    k_in_table_order = k.clone()
    k[table.long()] = k_in_table_order  # block i of the sequence lives at table[i]
    qkv = torch.randn(n, (hq + 2 * hkv) * d).abs() * spread
    out = torch.empty(n, hq * d)
    kernels.paged_prefill_attention(qkv, k, v, table, pos0, d**-0.5, out)
    want = _chunk_reference(qkv[:, : hq * d].reshape(n, hq, d), k, v, table, pos0, d**-0.5)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hq,hkv,d,bs,n,pos0,window",
    [
        (4, 1, 128, 16, 100, 0, 40),  # Mistral's heads, a first chunk longer than the window
        (4, 1, 128, 16, 50, 300, 37),  # a later chunk: blocks before every window unread
        (4, 4, 96, 16, 70, 20, 64),  # Phi-3's heads (the plain C P.V), window mid-block
        (4, 4, 48, 8, 33, 50, 20),  # 8-token blocks: the plain C path throughout
        (9, 3, 64, 16, 200, 1000, 4096),  # a window wider than the context: none at all
    ],
)
def test_paged_prefill_attention_slides_its_window(dtype, hq, hkv, d, bs, n, pos0, window):
    """Query i sees only keys after pos0 + i - window, as transformers masks them."""
    torch.manual_seed(window * 7 + n)
    nb = -(-(pos0 + n) // bs) + 2
    k = torch.randn(nb, hkv, d, bs).to(dtype)
    v = torch.randn(nb, hkv, bs, d).to(dtype)
    table = torch.randperm(nb).to(torch.int32)
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)
    out = torch.empty(n, hq * d, dtype=dtype)
    kernels.paged_prefill_attention(qkv, k, v, table, pos0, d**-0.5, out, window)
    q = qkv[:, : hq * d].reshape(n, hq, d)
    want = _chunk_reference(q, k, v, table, pos0, d**-0.5, window)
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)
    if window < pos0 + n:  # and the window changed the answer
        assert not torch.allclose(out.float(), _chunk_reference(q, k, v, table, pos0, d**-0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 128), (4, 4, 96), (4, 2, 96), (9, 3, 64)])
@pytest.mark.parametrize("window", [1, 17, 40, 333])
def test_paged_attention_slides_its_window(dtype, hq, hkv, d, window):
    """One query per sequence sees its last `window` tokens: contexts shorter than the
    window, ending mid-block, and long enough to split over threads."""
    bs, nblocks, lens = 16, 120, [5, 45, 700, 333]
    k_cache = rand(nblocks, hkv, d, bs, dtype=dtype, seed=21)
    v_cache = rand(nblocks, hkv, bs, d, dtype=dtype, seed=22)
    gen = torch.Generator().manual_seed(23)
    width = -(-max(lens) // bs)
    tables = torch.stack([torch.randperm(nblocks, generator=gen)[:width] for _ in lens]).int()
    q = rand(len(lens), (hq + 2 * hkv) * d, dtype=dtype, seed=24)
    out = torch.empty(len(lens), hq * d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    kernels.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5, out, window)
    for s, n in enumerate(lens):
        ids = tables[s, : -(-n // bs)].long()
        first = max(0, n - window)
        k = k_cache[ids].permute(1, 0, 3, 2).reshape(hkv, -1, d)[:, first:n].float()
        v = v_cache[ids].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, first:n].float()
        qs = q[s, : hq * d].float().view(hq, 1, d)
        ref = F.scaled_dot_product_attention(
            qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True
        )[0].reshape(hq * d)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out[s].float(), ref, atol=tol, rtol=tol), (s, n)
