/* Paged prefill attention for CPUs: a chunk of one sequence's queries against its KV in
 * place in the pool, causal.
 *
 * Why C: the torch path gathers the sequence's whole KV into a dense tensor for every
 * chunk and layer (at a 16k-token context that is ~25 MB a layer, again for each chunk)
 * and runs SDPA with an explicit mask. This reads each block where it lies, through the
 * sequence's block table, as the decode kernel (paged_attention.c) does.
 *
 * Layouts (row-major), as paged_attention.c:
 *   q      [n, >= num_q_heads * head_dim], rows q_stride apart      fp32 or bf16
 *   k      [num_blocks, num_kv_heads, head_dim, block_size]          bf16 or fp32
 *   v      [num_blocks, num_kv_heads, block_size, head_dim]          same dtype
 *   table  [blocks]  int32: the sequence's blocks in order
 *   out    [n, num_q_heads * head_dim]                               same dtype as q
 * Query i sits at position pos0 + i and attends keys 0 .. pos0 + i (itself included), or
 * with a sliding window W > 0 (Mistral, Phi-3) only the last W of them: keys after
 * pos0 + i - W, as transformers masks them. Blocks wholly before a tile's window are
 * not read.
 *
 * Work: a tile is one kv head and up to TQ consecutive query tokens; its rows are those
 * tokens times the G query heads sharing the kv head, so every K and V block read serves
 * G * TQ rows. Per block: the rows' scores (q.K, K transposed in the block so a row's 16
 * scores are one vector), an online softmax (running max and sum per row, as flash
 * attention keeps them), then P.V into fp32 accumulators. bf16 blocks are widened to
 * fp32 once per tile and block. Tiles are spread over the threads.
 *
 * A tile holds up to PF_MAX_ROWS rows: K and V are streamed from memory once per tile,
 * so fewer rows (16 at first) made a 16k-token context run at the cache's speed, not the
 * FMAs'. Inner kernels for 16-token blocks with AVX-512 (a row's scores one zmm, eight
 * rows per K load, P.V four rows by 64 columns in registers) or AVX2 (two ymm, six rows
 * per K load, P.V six rows by 16 columns, and a lazier softmax: see softmax_b16), plain C
 * for every other shape (docs/benchmarks.md has each against SDPA).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define PF_MAX_ROWS 192
#define PF_MAX_DIM 256
#define PF_MAX_BLOCK 64

typedef struct {
    const void *q; long q_stride; int act_bf16;
    const void *k, *v; int kv_bf16;
    const int32_t *table; int n, pos0, window;
    int num_q_heads, num_kv_heads, head_dim, block_size, G, tq;
    long block_stride, head_stride;
    float scale;
    void *out;
} PArgs;

/* Per-thread scratch: the tile's scaled queries, accumulators, scores, and a block of K
 * and V widened to fp32. */
typedef struct {
    float q[PF_MAX_ROWS * PF_MAX_DIM], acc[PF_MAX_ROWS * PF_MAX_DIM];
    float sc[PF_MAX_ROWS * PF_MAX_BLOCK];
    float kf[PF_MAX_DIM * PF_MAX_BLOCK], vf[PF_MAX_BLOCK * PF_MAX_DIM];
    float m[PF_MAX_ROWS], l[PF_MAX_ROWS];
    float lv[PF_MAX_ROWS * 8];  /* AVX2: each row's sum, a vector until the tile ends */
} Scratch;

static inline float q_at(const PArgs *a, long i) {
    return a->act_bf16 ? bf2f(((const uint16_t *)a->q)[i]) : ((const float *)a->q)[i];
}

/* A block's K ([D][B]) or V ([B][D]) as fp32: in place for fp32, widened for bf16. */
static const float *widen(const PArgs *a, const void *src, long at, float *dst) {
    const long count = (long)a->head_dim * a->block_size;
    if (!a->kv_bf16) return (const float *)src + at;
    const uint16_t *s = (const uint16_t *)src + at;
    #pragma omp simd
    for (long i = 0; i < count; i++) dst[i] = bf2f(s[i]);
    return dst;
}

static inline int clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* Keys of the block starting at `first_key` (nk of them) that row r of the tile at t0
 * may see, [*lo, return value): those at or before its query's position, and within its
 * window if there is one. */
static inline int row_valid(const PArgs *a, int r, int first_key, int nk, int t0, int *lo) {
    const int pos = a->pos0 + t0 + r / a->G;
    *lo = a->window > 0 ? clamp(pos - a->window + 1 - first_key, 0, nk) : 0;
    return clamp(pos - first_key + 1, 0, nk);
}

/* Row r's running max rises to new_m: its sum and accumulator scale down to match. */
static inline void rescale_row(Scratch *s, int r, int D, float new_m) {
    if (new_m == s->m[r]) return;
    const float corr = exp_approx(s->m[r] - new_m);
    s->l[r] *= corr;
    float *ar = s->acc + r * D;
    #pragma omp simd
    for (int d = 0; d < D; d++) ar[d] *= corr;
    s->m[r] = new_m;
}

/* ---- scores: sc[r][t] = q[r] . K[:, t] ------------------------------------------------ */
static void scores_generic(const float *q, int R, int D, const float *K, int B, float *sc) {
    for (int r = 0; r < R; r++) {
        float *s = sc + r * B;
        memset(s, 0, sizeof(float) * B);
        for (int d = 0; d < D; d++) {
            const float qd = q[r * D + d];
            #pragma omp simd
            for (int t = 0; t < B; t++) s[t] += qd * K[d * B + t];
        }
    }
}

#if defined(__AVX512F__)
#define PF_VECTOR 1
#define PF_DIM_MULTIPLE 16
/* 16-token blocks: a row's scores are one zmm; eight rows share each K row load (with
 * four, the broadcasts and loads outnumbered the FMAs). */
static void scores_b16(const float *q, int R, int D, const float *K, float *sc) {
    int r = 0;
    for (; r + 8 <= R; r += 8) {
        __m512 acc[8];
        for (int x = 0; x < 8; x++) acc[x] = _mm512_setzero_ps();
        const float *q0 = q + r * D;
        for (int d = 0; d < D; d++) {
            const __m512 k = _mm512_loadu_ps(K + d * 16);
            #pragma GCC unroll 8
            for (int x = 0; x < 8; x++)
                acc[x] = _mm512_fmadd_ps(_mm512_set1_ps(q0[x * D + d]), k, acc[x]);
        }
        for (int x = 0; x < 8; x++) _mm512_storeu_ps(sc + (r + x) * 16, acc[x]);
    }
    for (; r < R; r++) {
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < D; d++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), _mm512_loadu_ps(K + d * 16), a);
        _mm512_storeu_ps(sc + r * 16, a);
    }
}

/* The online softmax of 16-token blocks, a row a zmm: mask the keys row r may not see,
 * update its running max and sum, leave its probabilities in sc and rescale its
 * accumulator when the max moved. */
static void softmax_b16(const PArgs *a, Scratch *s, int R, int D, int first_key, int nk, int t0) {
    for (int r = 0; r < R; r++) {
        float *sr = s->sc + r * 16;
        int lo;
        const int valid = row_valid(a, r, first_key, nk, t0, &lo);
        const __mmask16 mask = (__mmask16)(((1u << valid) - 1u) & ~((1u << lo) - 1u));
        const __m512 x = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(sr));
        if (valid <= lo) {
            _mm512_storeu_ps(sr, _mm512_setzero_ps());
            continue;
        }
        const float bmax = _mm512_reduce_max_ps(x);
        const float new_m = bmax > s->m[r] ? bmax : s->m[r];
        const __m512 e = _mm512_maskz_mov_ps(mask, exp512_nonpos(_mm512_sub_ps(x, _mm512_set1_ps(new_m))));
        _mm512_storeu_ps(sr, e);
        rescale_row(s, r, D, new_m);
        s->l[r] += _mm512_reduce_add_ps(e);
    }
}

/* acc[r] += sum_t p[r][t] V[t] for ROWS rows over W zmm (16 floats each) of the head at
 * column j: constants, so the ROWS x W accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_tile(
    const float *p, int r, int D, int j, const float *V, int n, float *acc, const int ROWS,
    const int W) {
    __m512 c[4][4];
    #pragma GCC unroll 4
    for (int y = 0; y < ROWS; y++)
        #pragma GCC unroll 4
        for (int x = 0; x < W; x++) c[y][x] = _mm512_loadu_ps(acc + (r + y) * D + j + 16 * x);
    for (int t = 0; t < n; t++) {
        __m512 vr[4];
        #pragma GCC unroll 4
        for (int x = 0; x < W; x++) vr[x] = _mm512_loadu_ps(V + t * D + j + 16 * x);
        #pragma GCC unroll 4
        for (int y = 0; y < ROWS; y++) {
            const __m512 py = _mm512_set1_ps(p[(r + y) * 16 + t]);
            #pragma GCC unroll 4
            for (int x = 0; x < W; x++) c[y][x] = _mm512_fmadd_ps(py, vr[x], c[y][x]);
        }
    }
    #pragma GCC unroll 4
    for (int y = 0; y < ROWS; y++)
        #pragma GCC unroll 4
        for (int x = 0; x < W; x++) _mm512_storeu_ps(acc + (r + y) * D + j + 16 * x, c[y][x]);
}

/* head_dim a multiple of 16: four rows at a time over 64-wide slices of the head, each V
 * row slice loaded once for the four. */
static void pv_d16(const float *p, int R, int D, const float *V, int n, float *acc) {
    for (int j = 0; j < D; j += 64) {
        const int w = D - j < 64 ? (D - j) / 16 : 4;
        int r = 0;
        if (w == 4)
            for (; r + 4 <= R; r += 4) pv_tile(p, r, D, j, V, n, acc, 4, 4);
        for (; r < R; r++) {
            if (w == 4) pv_tile(p, r, D, j, V, n, acc, 1, 4);
            else if (w == 3) pv_tile(p, r, D, j, V, n, acc, 1, 3);
            else if (w == 2) pv_tile(p, r, D, j, V, n, acc, 1, 2);
            else pv_tile(p, r, D, j, V, n, acc, 1, 1);
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2: a 16-token block's scores are two ymm a row; six rows share each K row load
 * (twelve accumulators: with eight, the FMAs' latency was exposed). */
static inline __attribute__((always_inline)) void scores_rows(
    const float *q, int r, int D, const float *K, float *sc, const int ROWS) {
    __m256 lo[6], hi[6];
    #pragma GCC unroll 6
    for (int x = 0; x < ROWS; x++) lo[x] = hi[x] = _mm256_setzero_ps();
    const float *q0 = q + r * D;
    for (int d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(K + d * 16), k1 = _mm256_loadu_ps(K + d * 16 + 8);
        #pragma GCC unroll 6
        for (int x = 0; x < ROWS; x++) {
            const __m256 qd = _mm256_broadcast_ss(q0 + x * D + d);
            lo[x] = _mm256_fmadd_ps(qd, k0, lo[x]);
            hi[x] = _mm256_fmadd_ps(qd, k1, hi[x]);
        }
    }
    #pragma GCC unroll 6
    for (int x = 0; x < ROWS; x++) {
        _mm256_storeu_ps(sc + (r + x) * 16, lo[x]);
        _mm256_storeu_ps(sc + (r + x) * 16 + 8, hi[x]);
    }
}

static void scores_b16(const float *q, int R, int D, const float *K, float *sc) {
    int r = 0;
    for (; r + 6 <= R; r += 6) scores_rows(q, r, D, K, sc, 6);
    for (; r < R; r++) scores_rows(q, r, D, K, sc, 1);
}

/* The online softmax of 16-token blocks, a row two ymm, with two shortcuts that took a
 * quarter of the tile's time when every block paid for them:
 * - the running max moves only when a score passes it by more than LAZY_MAX (the
 *   probabilities stay at most e^8 ~ 3e3, far inside fp32), so most blocks skip the
 *   horizontal max and the rescale;
 * - a row's sum stays a vector (lv) until the tile ends, with no horizontal add a block;
 * - blocks every row sees whole (all but the chunk's diagonal) skip the masks. */
#define LAZY_MAX 8.0f
static void softmax_b16(const PArgs *a, Scratch *s, int R, int D, int first_key, int nk, int t0) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    /* row 0 sees all 16, and so does the last row (within its window) */
    const int last = a->pos0 + t0 + (R - 1) / a->G;
    const int whole = nk == 16 && a->pos0 + t0 >= first_key + 15 &&
                      (a->window <= 0 || last - a->window + 1 <= first_key);
    for (int r = 0; r < R; r++) {
        float *sr = s->sc + r * 16;
        __m256 x0 = _mm256_loadu_ps(sr), x1 = _mm256_loadu_ps(sr + 8);
        __m256 m0 = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), m1 = m0;
        if (!whole) {
            int lo;
            const int valid = row_valid(a, r, first_key, nk, t0, &lo);
            if (valid <= lo) {
                _mm256_storeu_ps(sr, _mm256_setzero_ps());
                _mm256_storeu_ps(sr + 8, _mm256_setzero_ps());
                continue;
            }
            /* lanes in [lo, valid): below valid and not below lo */
            m0 = _mm256_castsi256_ps(_mm256_andnot_si256(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), lane),
                _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane)));
            m1 = _mm256_castsi256_ps(_mm256_andnot_si256(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(lo - 8), lane),
                _mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8), lane)));
            x0 = _mm256_blendv_ps(ninf, x0, m0);
            x1 = _mm256_blendv_ps(ninf, x1, m1);
        }
        const __m256 mx = _mm256_max_ps(x0, x1);
        if (_mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(s->m[r] + LAZY_MAX), _CMP_GT_OQ))) {
            const float new_m = hmax256(mx);
            const __m256 corr = _mm256_set1_ps(exp_approx(s->m[r] - new_m));
            float *lr = s->lv + r * 8, *ar = s->acc + r * D;
            _mm256_storeu_ps(lr, _mm256_mul_ps(_mm256_loadu_ps(lr), corr));
            int d = 0;
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(ar + d, _mm256_mul_ps(_mm256_loadu_ps(ar + d), corr));
            for (; d < D; d++) ar[d] *= _mm256_cvtss_f32(corr);
            s->m[r] = new_m;
        }
        const __m256 nm = _mm256_set1_ps(s->m[r]);
        const __m256 e0 = _mm256_and_ps(m0, exp256_nonpos(_mm256_sub_ps(x0, nm)));
        const __m256 e1 = _mm256_and_ps(m1, exp256_nonpos(_mm256_sub_ps(x1, nm)));
        _mm256_storeu_ps(sr, e0);
        _mm256_storeu_ps(sr + 8, e1);
        float *lr = s->lv + r * 8;
        _mm256_storeu_ps(lr, _mm256_add_ps(_mm256_loadu_ps(lr), _mm256_add_ps(e0, e1)));
    }
}

/* acc[r] += sum_t p[r][t] V[t], head_dim a multiple of 8: up to six rows at a time over
 * 16-wide slices of the head (12 accumulators, 2 V loads and 6 broadcasts a key). */
static inline __attribute__((always_inline)) void pv_tile(
    const float *p, int r, int D, int j, const float *V, int n, float *acc, const int ROWS,
    const int W) {
    __m256 c[6][2];
    #pragma GCC unroll 6
    for (int y = 0; y < ROWS; y++)
        #pragma GCC unroll 2
        for (int x = 0; x < W; x++) c[y][x] = _mm256_loadu_ps(acc + (r + y) * D + j + 8 * x);
    for (int t = 0; t < n; t++) {
        __m256 vr[2];
        #pragma GCC unroll 2
        for (int x = 0; x < W; x++) vr[x] = _mm256_loadu_ps(V + t * D + j + 8 * x);
        #pragma GCC unroll 6
        for (int y = 0; y < ROWS; y++) {
            const __m256 py = _mm256_broadcast_ss(p + (r + y) * 16 + t);
            #pragma GCC unroll 2
            for (int x = 0; x < W; x++) c[y][x] = _mm256_fmadd_ps(py, vr[x], c[y][x]);
        }
    }
    #pragma GCC unroll 6
    for (int y = 0; y < ROWS; y++)
        #pragma GCC unroll 2
        for (int x = 0; x < W; x++) _mm256_storeu_ps(acc + (r + y) * D + j + 8 * x, c[y][x]);
}

static void pv_d16(const float *p, int R, int D, const float *V, int n, float *acc) {
    for (int j = 0; j < D; j += 16) {
        const int w = D - j < 16 ? 1 : 2;
        int r = 0;
        if (w == 2)
            for (; r + 6 <= R; r += 6) pv_tile(p, r, D, j, V, n, acc, 6, 2);
        for (; r < R; r++) {
            if (w == 2) pv_tile(p, r, D, j, V, n, acc, 1, 2);
            else pv_tile(p, r, D, j, V, n, acc, 1, 1);
        }
    }
}
#define PF_VECTOR 1
#define PF_DIM_MULTIPLE 8
#endif

static void pv_generic(const float *p, int R, int D, const float *V, int B, int n, float *acc) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < n; t++) {
            const float pr = p[r * B + t];
            #pragma omp simd
            for (int d = 0; d < D; d++) acc[r * D + d] += pr * V[t * D + d];
        }
}

static void softmax_generic(const PArgs *a, Scratch *s, int R, int D, int B, int k0, int nk,
                            int t0) {
    for (int r = 0; r < R; r++) {
        float *sr = s->sc + r * B;
        int lo;
        const int valid = row_valid(a, r, k0, nk, t0, &lo);
        float bmax = -INFINITY;
        for (int t = lo; t < valid; t++) bmax = sr[t] > bmax ? sr[t] : bmax;
        if (valid <= lo) {
            memset(sr, 0, sizeof(float) * B);
            continue;
        }
        const float new_m = bmax > s->m[r] ? bmax : s->m[r];
        float psum = 0.f;
        #pragma omp simd reduction(+:psum)
        for (int t = lo; t < valid; t++) {
            sr[t] = exp_approx(sr[t] - new_m);
            psum += sr[t];
        }
        for (int t = 0; t < lo; t++) sr[t] = 0.f;
        for (int t = valid; t < B; t++) sr[t] = 0.f;
        rescale_row(s, r, D, new_m);
        s->l[r] += psum;
    }
}

/* ---- one tile --------------------------------------------------------------------------- */
static void tile(const PArgs *a, int h, int t0, Scratch *s) {
    const int G = a->G, D = a->head_dim, B = a->block_size;
    const int tq = a->n - t0 < a->tq ? a->n - t0 : a->tq, R = tq * G;
    for (int r = 0; r < R; r++) {  /* row r: token t0 + r / G, query head h*G + r % G */
        const long qi = (long)(t0 + r / G) * a->q_stride + (long)(h * G + r % G) * D;
        for (int d = 0; d < D; d++) s->q[r * D + d] = q_at(a, qi + d) * a->scale;
        s->m[r] = -INFINITY;
        s->l[r] = 0.f;
    }
    memset(s->acc, 0, sizeof(float) * R * D);
    memset(s->lv, 0, sizeof(float) * R * 8);
    const int keys = a->pos0 + t0 + tq;  /* the tile's last row sees this many */
    const int fast = B == 16;
    /* the tile's first row has the earliest window: blocks before it are no row's */
    const int first = a->window > 0 ? clamp(a->pos0 + t0 - a->window + 1, 0, keys) : 0;
    for (int b = first / B; b * B < keys; b++) {
        const int k0 = b * B, nk = keys - k0 < B ? keys - k0 : B;
        const long at = (long)a->table[b] * a->block_stride + (long)h * a->head_stride;
        const float *K = widen(a, a->k, at, s->kf);
#if defined(PF_VECTOR)
        if (fast) scores_b16(s->q, R, D, K, s->sc);
        else
#endif
            scores_generic(s->q, R, D, K, B, s->sc);
        (void)fast;
#if defined(PF_VECTOR)
        if (fast) softmax_b16(a, s, R, D, k0, nk, t0);
        else
#endif
            softmax_generic(a, s, R, D, B, k0, nk, t0);
        const float *V = widen(a, a->v, at, s->vf);
#if defined(PF_VECTOR)
        if (fast && D % PF_DIM_MULTIPLE == 0) pv_d16(s->sc, R, D, V, nk, s->acc);
        else
#endif
            pv_generic(s->sc, R, D, V, B, nk, s->acc);
    }
    for (int r = 0; r < R; r++) {
        for (int x = 0; x < 8; x++) s->l[r] += s->lv[r * 8 + x];
        const float inv = s->l[r] > 0.f ? 1.f / s->l[r] : 0.f;
        const long oi = ((long)(t0 + r / G) * a->num_q_heads + h * G + r % G) * D;
        for (int d = 0; d < D; d++) {
            const float v = s->acc[r * D + d] * inv;
            if (a->act_bf16) ((uint16_t *)a->out)[oi + d] = f2bf(v);
            else ((float *)a->out)[oi + d] = v;
        }
    }
}

static int prefill(const PArgs *a, int num_threads) {
    if (a->G < 1 || a->G > PF_MAX_ROWS || a->head_dim > PF_MAX_DIM || a->block_size > PF_MAX_BLOCK)
        return -1;
    const int tiles = (a->n + a->tq - 1) / a->tq, items = tiles * a->num_kv_heads;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        Scratch *s = (Scratch *)malloc(sizeof(Scratch));
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        /* Longest tiles (the chunk's end sees the most keys) first, so the threads finish
         * together. */
        #pragma omp for schedule(dynamic)
        for (int i = 0; i < items; i++)
            if (s) tile(a, i % a->num_kv_heads, (tiles - 1 - i / a->num_kv_heads) * a->tq, s);
        free(s);
    }
    return failed ? -2 : 0;
}

#define DEFINE_PREFILL(NAME, KV_BF16)                                                        \
int NAME(const void *q, long q_stride, int act_bf16, const void *k_cache,                  \
         const void *v_cache, const int32_t *table, int n, int pos0, int window,            \
         int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,     \
         void *out, int num_threads) {                                                      \
    const int G = num_kv_heads ? num_q_heads / num_kv_heads : 0;                            \
    PArgs a = {q, q_stride, act_bf16, k_cache, v_cache, KV_BF16, table, n, pos0, window,    \
               num_q_heads, num_kv_heads, head_dim, block_size, G,                          \
               G ? PF_MAX_ROWS / G : 1,                                                     \
               (long)block_size * head_dim * num_kv_heads, (long)block_size * head_dim,     \
               scale, out};                                                                 \
    return prefill(&a, num_threads);                                                        \
}

DEFINE_PREFILL(paged_prefill_attention_bf16, 1)
DEFINE_PREFILL(paged_prefill_attention_f32, 0)
