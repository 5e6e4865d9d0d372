/* Paged decode attention for CPUs: one query token per sequence, KV read in place.
 *
 * Why C: torch has no paged attention on CPU; gathering every sequence's blocks into a
 * dense tensor each step costs more memory traffic than the attention itself. This reads
 * each sequence's blocks straight from the pool through its block table, keeps scores in
 * fp32 with a per-block online softmax, and splits the work over (sequence, kv head,
 * context part): with few sequences, a long context is cut into parts whose partial
 * softmax states are merged at the end (flash-decoding), so every thread has work.
 *
 * Layouts (row-major). K is stored transposed inside a block so that q.K for all of a
 * block's tokens is a run of vector FMAs over tokens, with no horizontal sums:
 *   q            [num_seqs, num_q_heads, head_dim], rows q_stride apart   fp32 or bf16
 *   k cache      [num_blocks, num_kv_heads, head_dim, block_size]  bf16 (uint16) or fp32
 *   v cache      [num_blocks, num_kv_heads, block_size, head_dim]  same dtype
 *   block_tables [num_seqs, max_blocks]                            int32
 *   ctx_lens     [num_seqs]                                        int32 (tokens to attend)
 * With a sliding window W > 0 (Mistral, Phi-3) a sequence attends only its last W
 * tokens, as transformers masks them: blocks wholly before them are not read.
 *   out          [num_seqs, num_q_heads * head_dim]                 same dtype as q
 * Query heads h*G .. h*G+G-1 share kv head h (grouped-query attention).
 *
 * Two inner kernels compute the same thing: an AVX-512 one for the common shape (16-token
 * blocks, head_dim a multiple of 16, G*head_dim <= 256: every accumulator in a register;
 * the plain C one converted bf16 a lane at a time and ran 3x slower than memory), and the
 * plain C one for everything else.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64
#define MIN_BLOCKS_PER_PART 4

/* One work item's partial softmax state for its G query heads, in a flat scratch buffer:
 * m[G], l[G], then acc[G][head_dim] (unnormalized). */
typedef struct {
    float *m, *l, *acc;
} Partial;

static inline Partial partial_at(float *scratch, long index, int G, int D) {
    float *base = scratch + index * (long)(2 * G + G * D);
    Partial p = {base, base + G, base + 2 * G};
    return p;
}

/* exp(x) for x <= 0 (scores minus their running max). */
static inline float exp_nonpos(float x) { return exp_approx(x); }

typedef struct {
    const void *q; long q_stride; int act_bf16;
    const void *k, *v; int kv_bf16;
    const int32_t *tables; int max_blocks; const int32_t *ctx;
    int num_q_heads, num_kv_heads, head_dim, block_size, G;
    long block_stride, head_stride;
    float scale;
    int window;
} Args;

/* The first token sequence s attends (0 without a window). */
static inline int window_start(const Args *a, int s) {
    return a->window > 0 && a->ctx[s] > a->window ? a->ctx[s] - a->window : 0;
}

static inline float kv_at(const void *p, long i, int bf16) {
    return bf16 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void load_q(const Args *a, int s, int h, float qv[MAX_GROUP][MAX_DIM]) {
    for (int g = 0; g < a->G; g++) {
        const long qi = (long)s * a->q_stride + (long)(h * a->G + g) * a->head_dim;
        for (int d = 0; d < a->head_dim; d++)
            qv[g][d] = (a->act_bf16 ? bf2f(((const uint16_t *)a->q)[qi + d])
                                    : ((const float *)a->q)[qi + d]) * a->scale;
    }
}

/* ---- plain C: any shape ------------------------------------------------------------- */
static void part_generic(const Args *a, int s, int h, int b0, int b1, const Partial *out) {
    const int G = a->G, D = a->head_dim, bs = a->block_size, len = a->ctx[s];
    const int start = window_start(a, s);
    float qv[MAX_GROUP][MAX_DIM], sc[MAX_GROUP][MAX_BLOCK], row[MAX_DIM > MAX_BLOCK ? MAX_DIM : MAX_BLOCK];
    load_q(a, s, h, qv);
    /* `out` holds the running state: reset by the caller (reset_partial) before the first
     * range of blocks, carried across the ranges after it. */
    const int32_t *table = a->tables + (long)s * a->max_blocks;
    for (int b = b0; b < b1; b++) {
        const long base = (long)table[b] * a->block_stride + (long)h * a->head_stride;
        const int rest = len - b * bs, n = rest < bs ? rest : bs;
        const int t0 = start > b * bs ? start - b * bs : 0;  /* tokens before: out of window */
        for (int g = 0; g < G; g++) memset(sc[g], 0, sizeof(float) * bs);
        for (int d = 0; d < D; d++) {  /* each K row (one dim, all tokens) converted once */
            for (int t = 0; t < bs; t++) row[t] = kv_at(a->k, base + (long)d * bs + t, a->kv_bf16);
            for (int g = 0; g < G; g++) {
                const float qd = qv[g][d];
                #pragma omp simd
                for (int t = 0; t < bs; t++) sc[g][t] += qd * row[t];
            }
        }
        for (int g = 0; g < G; g++) {
            float bmax = -INFINITY;
            for (int t = t0; t < n; t++) bmax = sc[g][t] > bmax ? sc[g][t] : bmax;
            const float new_m = bmax > out->m[g] ? bmax : out->m[g];
            const float corr = expf(out->m[g] - new_m);
            float psum = 0.f;
            #pragma omp simd reduction(+:psum)
            for (int t = t0; t < n; t++) {
                sc[g][t] = exp_nonpos(sc[g][t] - new_m);
                psum += sc[g][t];
            }
            out->l[g] = out->l[g] * corr + psum;
            out->m[g] = new_m;
            for (int d = 0; d < D; d++) out->acc[g * D + d] *= corr;
        }
        for (int t = t0; t < n; t++) {  /* each V row converted once for all G heads */
            for (int d = 0; d < D; d++) row[d] = kv_at(a->v, base + (long)t * D + d, a->kv_bf16);
            for (int g = 0; g < G; g++) {
                const float p = sc[g][t];
                #pragma omp simd
                for (int d = 0; d < D; d++) out->acc[g * D + d] += p * row[d];
            }
        }
    }
}

#if defined(__AVX512F__)
/* ---- AVX-512: 16-token blocks, one zmm per K row, accumulators in registers ---------- */
static inline __m512 load16(const void *p, long i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

#define AVX_MAX_ACC 16 /* zmm accumulators: G * head_dim / 16 */

/* Up to SB blocks (64 tokens) at a time: each broadcast of a q value meets four K rows,
 * which halved the loads per FMA (q.K was load-bound), and the softmax bookkeeping
 * (reductions, rescaling) runs once per 64 tokens instead of once per 16. */
#define SB 4

/* Which of each block's 16 tokens are attended: before the context's end and, with a
 * window, not before its start. Blocks q >= nb (padding to SB) have none. */
static inline __attribute__((always_inline)) void block_masks(
    int len, int start, int b, int nb, int sb, __mmask16 valid[SB]) {
    #pragma GCC unroll 4
    for (int q = 0; q < sb; q++) {
        const int rest = q < nb ? len - (b + q) * 16 : 0;
        valid[q] = rest >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (rest > 0 ? rest : 0)) - 1u);
        const int before = start - (b + q) * 16;  /* tokens out of the window */
        if (before > 0) valid[q] &= (__mmask16)~((1u << (before < 16 ? before : 16)) - 1u);
    }
}

/* One head's online softmax over sb blocks of scores: masks them, stores their
 * exponentials in p, carries the running max *m and sum *l, and returns the factor its
 * accumulators must be rescaled by. */
static inline __attribute__((always_inline)) float softmax_blocks(
    __m512 sc[SB], const __mmask16 valid[SB], int sb, float *m, float *l, float *p) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    #pragma GCC unroll 4
    for (int q = 0; q < sb; q++) {
        sc[q] = _mm512_mask_blend_ps(valid[q], _mm512_set1_ps(-INFINITY), sc[q]);
        mx = _mm512_max_ps(mx, sc[q]);
    }
    const float bmax = _mm512_reduce_max_ps(mx);
    const float new_m = bmax > *m ? bmax : *m;
    /* inline, not libm's expf: a call makes every accumulator spill around it */
    const float corr = exp_nonpos(*m - new_m);
    __m512 sum = _mm512_setzero_ps();
    #pragma GCC unroll 4
    for (int q = 0; q < sb; q++) {
        const __m512 e = _mm512_maskz_mov_ps(
            valid[q], exp512_nonpos(_mm512_sub_ps(sc[q], _mm512_set1_ps(new_m))));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(p + q * 16, e);
    }
    *l = *l * corr + _mm512_reduce_add_ps(sum);
    *m = new_m;
    return corr;
}

static inline __attribute__((always_inline)) void part_avx512_g(
    const Args *a, int s, int h, int b0, int b1, const Partial *out, const int G, const int DV) {
    /* DV = head_dim / 16 zmm per head */
    const int D = DV * 16, len = a->ctx[s], bf = a->kv_bf16, start = window_start(a, s);
    float qv[MAX_GROUP][MAX_DIM];
    float p[MAX_GROUP][SB * 16];
    load_q(a, s, h, qv);
    __m512 acc[AVX_MAX_ACC];
    float m[MAX_GROUP], l[MAX_GROUP];
    /* the running state in `out` (reset before the first range, see reset_partial) */
    #pragma GCC unroll 16
    for (int g = 0; g < G; g++) {
        m[g] = out->m[g]; l[g] = out->l[g];
        #pragma GCC unroll 16
        for (int j = 0; j < DV; j++) acc[g * DV + j] = _mm512_loadu_ps(out->acc + g * D + j * 16);
    }
    const int32_t *table = a->tables + (long)s * a->max_blocks;
    for (int b = b0; b < b1; b += SB) {
        const int nb = b1 - b < SB ? b1 - b : SB;
        long base[SB];
        #pragma GCC unroll 4
        for (int q = 0; q < SB; q++)  /* missing blocks repeat the last one, masked below */
            base[q] = (long)table[b + (q < nb ? q : nb - 1)] * a->block_stride + (long)h * a->head_stride;
        __m512 sc[MAX_GROUP][SB];
        #pragma GCC unroll 16
        for (int g = 0; g < G; g++)
            #pragma GCC unroll 4
            for (int q = 0; q < SB; q++) sc[g][q] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            __m512 kr[SB];
            #pragma GCC unroll 4
            for (int q = 0; q < SB; q++) kr[q] = load16(a->k, base[q] + (long)d * 16, bf);
            #pragma GCC unroll 16
            for (int g = 0; g < G; g++) {
                const __m512 qd = _mm512_set1_ps(qv[g][d]);
                #pragma GCC unroll 4
                for (int q = 0; q < SB; q++) sc[g][q] = _mm512_fmadd_ps(qd, kr[q], sc[g][q]);
            }
        }
        __mmask16 valid[SB];
        block_masks(len, start, b, nb, SB, valid);
        #pragma GCC unroll 16
        for (int g = 0; g < G; g++) {
            const float corr = softmax_blocks(sc[g], valid, SB, &m[g], &l[g], p[g]);
            const __m512 c = _mm512_set1_ps(corr);
            #pragma GCC unroll 16
            for (int j = 0; j < DV; j++) acc[g * DV + j] = _mm512_mul_ps(acc[g * DV + j], c);
        }
        for (int q = 0; q < nb; q++) {
            const int rest = len - (b + q) * 16, n = rest < 16 ? rest : 16;
            const int before = start - (b + q) * 16;
            for (int t = before > 0 ? before : 0; t < n; t++) {
                __m512 vr[MAX_DIM / 16];
                #pragma GCC unroll 16
                for (int j = 0; j < DV; j++) vr[j] = load16(a->v, base[q] + (long)t * D + j * 16, bf);
                #pragma GCC unroll 16
                for (int g = 0; g < G; g++) {
                    const __m512 pg = _mm512_set1_ps(p[g][q * 16 + t]);
                    #pragma GCC unroll 16
                    for (int j = 0; j < DV; j++) acc[g * DV + j] = _mm512_fmadd_ps(pg, vr[j], acc[g * DV + j]);
                }
            }
        }
    }
    #pragma GCC unroll 16
    for (int g = 0; g < G; g++) {
        out->m[g] = m[g]; out->l[g] = l[g];
        #pragma GCC unroll 16
        for (int j = 0; j < DV; j++) _mm512_storeu_ps(out->acc + g * D + j * 16, acc[g * DV + j]);
    }
}

/* The shapes worth a constant (so loops unroll and accumulators stay in registers), each
 * its own function: inlined together into one, they spilled each other's registers. */
#define SHAPE(G_, DV_) \
    static __attribute__((noinline)) void part_g##G_##_dv##DV_(                         \
        const Args *a, int s, int h, int b0, int b1, const Partial *out) {                  \
        part_avx512_g(a, s, h, b0, b1, out, G_, DV_);                                       \
    }
SHAPE(1, 4) SHAPE(2, 4) SHAPE(3, 4) SHAPE(4, 4) SHAPE(1, 8) SHAPE(2, 8)
SHAPE(1, 6) SHAPE(2, 6)  /* head_dim 96: Phi-3 */

/* ---- AVX-512, bf16 KV: two rows per load, no widening ---------------------------------
 * A bf16 value is the top half of an fp32 one, so a 64-byte load of two K rows (d, d+1:
 * 16 tokens each) gives fp32 values by a shift (the even elements) and a mask (the odd
 * ones): one load and two ops per 32 values, where widening 16 at a time took two loads
 * and four. The even vector holds tokens 0,2,..,14 of row d then of row d+1, so its FMAs
 * take q[d] in the low lanes and q[d+1] in the high ones; the halves are added at the
 * end of the block. V rows split the same way into even and odd dimensions, which the
 * accumulators keep apart until the running state is stored. Zen 4 and Xeon alike ran
 * this kernel compute-bound, below the memory's rate, before the change. */
static inline __m512 bf_lo(__m512i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)); }
static inline __m512 bf_hi(__m512i raw) {
    return _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
}
/* Interleave: lanes (a0, b0, a1, b1, ..) from the low (IL_LO) or high (IL_HI) halves. */
#define IL_LO _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
#define IL_HI _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8)
#define EVENS _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0)
#define ODDS _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1)

static inline __attribute__((always_inline)) void part_bf16_g(
    const Args *a, int s, int h, int b0, int b1, const Partial *out, const int G, const int DC,
    const int SBB) {
    /* DC = head_dim / 32 chunks of 32 dimensions; SBB blocks of 16 tokens at a time */
    const int D = DC * 32, len = a->ctx[s], start = window_start(a, s);
    const uint16_t *K = (const uint16_t *)a->k, *V = (const uint16_t *)a->v;
    float qv[MAX_GROUP][MAX_DIM];
    load_q(a, s, h, qv);
    /* qp[g][r]: q[g][2r] in the low 8 lanes, q[g][2r+1] in the high 8 */
    __m512 qp[MAX_GROUP][MAX_DIM / 2];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < D / 2; r++)
            qp[g][r] = _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(qv[g][2 * r]),
                                            _mm512_set1_ps(qv[g][2 * r + 1]));
    __m512 ae[AVX_MAX_ACC / 2], ao[AVX_MAX_ACC / 2];  /* [g * DC + c]: even / odd dims */
    float m[MAX_GROUP], l[MAX_GROUP], p[MAX_GROUP][SB * 16];
    #pragma GCC unroll 16
    for (int g = 0; g < G; g++) {
        m[g] = out->m[g]; l[g] = out->l[g];
        #pragma GCC unroll 8
        for (int c = 0; c < DC; c++) {
            const __m512 x0 = _mm512_loadu_ps(out->acc + g * D + c * 32);
            const __m512 x1 = _mm512_loadu_ps(out->acc + g * D + c * 32 + 16);
            ae[g * DC + c] = _mm512_permutex2var_ps(x0, EVENS, x1);
            ao[g * DC + c] = _mm512_permutex2var_ps(x0, ODDS, x1);
        }
    }
    const int32_t *table = a->tables + (long)s * a->max_blocks;
    for (int b = b0; b < b1; b += SBB) {
        const int nb = b1 - b < SBB ? b1 - b : SBB;
        long base[SB];
        #pragma GCC unroll 4
        for (int q = 0; q < SBB; q++)
            base[q] = (long)table[b + (q < nb ? q : nb - 1)] * a->block_stride + (long)h * a->head_stride;
        __m512 se[MAX_GROUP][SB], so[MAX_GROUP][SB];
        #pragma GCC unroll 16
        for (int g = 0; g < G; g++)
            #pragma GCC unroll 4
            for (int q = 0; q < SBB; q++) se[g][q] = so[g][q] = _mm512_setzero_ps();
        for (int r = 0; r < D / 2; r++) {
            __m512 qd[MAX_GROUP];
            #pragma GCC unroll 16
            for (int g = 0; g < G; g++) qd[g] = qp[g][r];
            #pragma GCC unroll 4
            for (int q = 0; q < SBB; q++) {
                const __m512i raw = _mm512_loadu_si512(K + base[q] + (long)r * 32);
                const __m512 ke = bf_lo(raw), ko = bf_hi(raw);
                #pragma GCC unroll 16
                for (int g = 0; g < G; g++) {
                    se[g][q] = _mm512_fmadd_ps(qd[g], ke, se[g][q]);
                    so[g][q] = _mm512_fmadd_ps(qd[g], ko, so[g][q]);
                }
            }
        }
        __mmask16 valid[SB];
        block_masks(len, start, b, nb, SBB, valid);
        #pragma GCC unroll 16
        for (int g = 0; g < G; g++) {
            __m512 sc[SB];
            #pragma GCC unroll 4
            for (int q = 0; q < SBB; q++)  /* token order: row halves added, evens/odds woven */
                sc[q] = _mm512_add_ps(_mm512_permutex2var_ps(se[g][q], IL_LO, so[g][q]),
                                      _mm512_permutex2var_ps(se[g][q], IL_HI, so[g][q]));
            const float corr = softmax_blocks(sc, valid, SBB, &m[g], &l[g], p[g]);
            const __m512 cv = _mm512_set1_ps(corr);
            #pragma GCC unroll 8
            for (int c = 0; c < DC; c++) {
                ae[g * DC + c] = _mm512_mul_ps(ae[g * DC + c], cv);
                ao[g * DC + c] = _mm512_mul_ps(ao[g * DC + c], cv);
            }
        }
        for (int q = 0; q < nb; q++) {
            const int rest = len - (b + q) * 16, n = rest < 16 ? rest : 16;
            const int before = start - (b + q) * 16;
            for (int t = before > 0 ? before : 0; t < n; t++) {
                #pragma GCC unroll 8
                for (int c = 0; c < DC; c++) {
                    const __m512i raw = _mm512_loadu_si512(V + base[q] + (long)t * D + c * 32);
                    const __m512 ve = bf_lo(raw), vo = bf_hi(raw);
                    #pragma GCC unroll 16
                    for (int g = 0; g < G; g++) {
                        const __m512 pg = _mm512_set1_ps(p[g][q * 16 + t]);
                        ae[g * DC + c] = _mm512_fmadd_ps(pg, ve, ae[g * DC + c]);
                        ao[g * DC + c] = _mm512_fmadd_ps(pg, vo, ao[g * DC + c]);
                    }
                }
            }
        }
    }
    #pragma GCC unroll 16
    for (int g = 0; g < G; g++) {
        out->m[g] = m[g]; out->l[g] = l[g];
        #pragma GCC unroll 8
        for (int c = 0; c < DC; c++) {
            const __m512 e = ae[g * DC + c], o = ao[g * DC + c];
            _mm512_storeu_ps(out->acc + g * D + c * 32, _mm512_permutex2var_ps(e, IL_LO, o));
            _mm512_storeu_ps(out->acc + g * D + c * 32 + 16, _mm512_permutex2var_ps(e, IL_HI, o));
        }
    }
}

#define SHAPE_BF16(G_, DC_, SB_) \
    static __attribute__((noinline)) void part_bf16_g##G_##_dc##DC_(                      \
        const Args *a, int s, int h, int b0, int b1, const Partial *out) {                  \
        part_bf16_g(a, s, h, b0, b1, out, G_, DC_, SB_);                                    \
    }
SHAPE_BF16(1, 2, 4) SHAPE_BF16(2, 2, 4) SHAPE_BF16(3, 2, 4) SHAPE_BF16(4, 2, 2)
SHAPE_BF16(1, 4, 4) SHAPE_BF16(2, 4, 2)

static int part_avx512(const Args *a, int s, int h, int b0, int b1, const Partial *out) {
    if (a->block_size != 16) return 0;
    const int dv = a->head_dim / 16;
    if (a->head_dim % 16) return 0;
    if (a->kv_bf16 && a->head_dim % 32 == 0) {  /* two rows per load (above) */
        const int dc = a->head_dim / 32;
        if (dc == 2 && a->G == 3) { part_bf16_g3_dc2(a, s, h, b0, b1, out); return 1; }
        if (dc == 2 && a->G == 4) { part_bf16_g4_dc2(a, s, h, b0, b1, out); return 1; }
        if (dc == 2 && a->G == 2) { part_bf16_g2_dc2(a, s, h, b0, b1, out); return 1; }
        if (dc == 2 && a->G == 1) { part_bf16_g1_dc2(a, s, h, b0, b1, out); return 1; }
        if (dc == 4 && a->G == 2) { part_bf16_g2_dc4(a, s, h, b0, b1, out); return 1; }
        if (dc == 4 && a->G == 1) { part_bf16_g1_dc4(a, s, h, b0, b1, out); return 1; }
    }
    if (dv == 4 && a->G == 3) part_g3_dv4(a, s, h, b0, b1, out);
    else if (dv == 4 && a->G == 4) part_g4_dv4(a, s, h, b0, b1, out);
    else if (dv == 4 && a->G == 2) part_g2_dv4(a, s, h, b0, b1, out);
    else if (dv == 4 && a->G == 1) part_g1_dv4(a, s, h, b0, b1, out);
    else if (dv == 8 && a->G == 2) part_g2_dv8(a, s, h, b0, b1, out);
    else if (dv == 8 && a->G == 1) part_g1_dv8(a, s, h, b0, b1, out);
    else if (dv == 6 && a->G == 1) part_g1_dv6(a, s, h, b0, b1, out);
    else if (dv == 6 && a->G == 2) part_g2_dv6(a, s, h, b0, b1, out);
    else return 0;
    return 1;
}
#endif

static void run_part(const Args *a, int s, int h, int b0, int b1, const Partial *out) {
#if defined(__AVX512F__)
    if (part_avx512(a, s, h, b0, b1, out)) return;
#endif
    part_generic(a, s, h, b0, b1, out);
}

/* Merge the parts' softmax states of one (sequence, kv head) and write its G heads. */
static void finish(const Args *a, float *scratch, long first, int num_parts, int s, int h,
                   void *out) {
    const int D = a->head_dim, G = a->G;
    Partial parts[64];
    for (int p = 0; p < num_parts; p++) parts[p] = partial_at(scratch, first + p, G, D);
    for (int g = 0; g < G; g++) {
        float M = -INFINITY;
        for (int p = 0; p < num_parts; p++) M = parts[p].m[g] > M ? parts[p].m[g] : M;
        float L = 0.f, w[64];
        for (int p = 0; p < num_parts; p++) {
            w[p] = parts[p].l[g] > 0.f ? expf(parts[p].m[g] - M) : 0.f;
            L += parts[p].l[g] * w[p];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        const long oi = ((long)s * a->num_q_heads + h * a->G + g) * D;
        for (int d = 0; d < D; d++) {
            float v = 0.f;
            for (int p = 0; p < num_parts; p++) v += parts[p].acc[g * D + d] * w[p];
            v *= inv;
            if (a->act_bf16) ((uint16_t *)out)[oi + d] = f2bf(v);
            else ((float *)out)[oi + d] = v;
        }
    }
}

static void reset_partial(const Partial *p, int G, int D) {
    for (int g = 0; g < G; g++) { p->m[g] = -INFINITY; p->l[g] = 0.f; }
    memset(p->acc, 0, sizeof(float) * G * D);
}

/* Blocks per visit of one head: all of a sequence's heads are walked together, a few
 * blocks at a time, so each block's K and V (all heads side by side in the pool) are read
 * from memory once, in order, rather than a head's slice at a time by different threads
 * (that ran at about half the bandwidth). */
#define BLOCKS_PER_VISIT 4

#ifndef PF_AHEAD
#define PF_AHEAD (2 * BLOCKS_PER_VISIT)
#endif
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif
static void prefetch_blocks(const Args *a, const int32_t *table, int from, int to, int end,
                            long block_bytes) {
    for (int b = from; b < to && b < end; b++)
        for (long o = 0; o < block_bytes; o += 64) {
            __builtin_prefetch((const char *)a->k + table[b] * block_bytes + o, 0, PF_LOCALITY);
            __builtin_prefetch((const char *)a->v + table[b] * block_bytes + o, 0, PF_LOCALITY);
        }
}

static int attention(const Args *a, int num_seqs, void *out, int num_threads) {
    if (a->G > MAX_GROUP || a->head_dim > MAX_DIM || a->block_size > MAX_BLOCK) return -1;
    /* Parts per sequence: enough work items for every thread, but at least a few blocks
     * each, and the same for all sequences (the longest context decides). */
    int max_blocks = 0;  /* the most blocks a sequence reads (from its window's start) */
    for (int s = 0; s < num_seqs; s++) {
        const int nb = (a->ctx[s] + a->block_size - 1) / a->block_size;
        const int span = nb - window_start(a, s) / a->block_size;
        max_blocks = span > max_blocks ? span : max_blocks;
    }
    int parts = (4 * num_threads + num_seqs - 1) / num_seqs;
    const int by_len = max_blocks / MIN_BLOCKS_PER_PART;
    parts = parts > by_len ? by_len : parts;
    parts = parts < 1 ? 1 : (parts > 64 ? 64 : parts);
    const int G = a->G, D = a->head_dim, H = a->num_kv_heads;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)num_seqs * H * parts * (2 * G + G * D));
    if (!scratch) return -2;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for collapse(2) schedule(dynamic)
        for (int s = 0; s < num_seqs; s++)
            for (int p = 0; p < parts; p++) {
                const int nb = (a->ctx[s] + a->block_size - 1) / a->block_size;
                const int lb = window_start(a, s) / a->block_size, span = nb - lb;
                const int per = (span + parts - 1) / parts;
                const int b0 = lb + (p * per < span ? p * per : span);
                const int b1 = b0 + per < nb ? b0 + per : nb;
                for (int h = 0; h < H; h++) {  /* an empty part stays the neutral state */
                    const Partial dst = partial_at(scratch, ((long)s * H + h) * parts + p, G, D);
                    reset_partial(&dst, G, D);
                }
                const int32_t *table = a->tables + (long)s * a->max_blocks;
                const long block_bytes = a->block_stride * (a->kv_bf16 ? 2 : 4);
                prefetch_blocks(a, table, b0, b0 + PF_AHEAD, b1, block_bytes);
                for (int b = b0; b < b1; b += BLOCKS_PER_VISIT) {
                    const int e = b + BLOCKS_PER_VISIT < b1 ? b + BLOCKS_PER_VISIT : b1;
                    /* later visits' blocks are elsewhere in the pool: fetch them meanwhile */
                    prefetch_blocks(a, table, b + PF_AHEAD, e + PF_AHEAD, b1, block_bytes);
                    for (int h = 0; h < H; h++) {
                        const Partial dst = partial_at(scratch, ((long)s * H + h) * parts + p, G, D);
                        run_part(a, s, h, b, e, &dst);
                    }
                }
            }
        #pragma omp for collapse(2) schedule(static)
        for (int s = 0; s < num_seqs; s++)
            for (int h = 0; h < H; h++)
                finish(a, scratch, ((long)s * H + h) * parts, parts, s, h, out);
    }
    free(scratch);
    return 0;
}

#define DEFINE_ENTRY(NAME, KV_BF16)                                                          \
int NAME(const void *q, long q_stride, int act_bf16, const void *k_cache,                  \
         const void *v_cache, const int32_t *block_tables, int max_blocks,                  \
         const int32_t *ctx_lens, int num_seqs, int num_q_heads, int num_kv_heads,          \
         int head_dim, int block_size, float scale, int window, void *out,                  \
         int num_threads) {                                                                 \
    Args a = {q, q_stride, act_bf16, k_cache, v_cache, KV_BF16, block_tables, max_blocks,   \
              ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size,                    \
              num_kv_heads ? num_q_heads / num_kv_heads : 0,                                \
              (long)block_size * head_dim * num_kv_heads, (long)block_size * head_dim,      \
              scale, window};                                                               \
    return attention(&a, num_seqs, out, num_threads);                                       \
}

DEFINE_ENTRY(paged_decode_attention_bf16, 1)
DEFINE_ENTRY(paged_decode_attention_f32, 0)
