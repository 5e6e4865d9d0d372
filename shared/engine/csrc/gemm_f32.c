/* y = x W^T in fp32 for any number of rows, on weights packed in panels.
 *
 * Why: the fp32 GEMV (gemv.c) reduces each output across K inside a vector, so every
 * output ends in a horizontal sum and its 4x4 tile reuses each load four times; past a
 * few rows it ran at about 70% of the fp32 peak, and MKL at 60-75% at the shapes of a
 * decode step or a prefill chunk (AVX-512 EPYC, 2 threads: a 32-row step's linears took
 * 61-85 ms through the GEMV, 87-113 through MKL, 41-51 through this kernel; 512-row
 * chunks ran at 196-204 GFLOP/s here against MKL's 115-165).
 *
 * The layout is gemm_bf16.c's, without the K pairs: panels of GN=32 output columns,
 *     packed[N/GN][K][GN]
 * so a panel is one sequential stream. A tile of rows of x against a panel keeps its
 * accumulators in registers: for each k it loads the panel's 32 weights once and
 * broadcasts each row's x[k] into them. No horizontal sums; threads split the panels, so
 * each reads its part of W from memory once, and one row is as fast as the GEMV.
 *   AVX-512: 12 rows x 32 columns (24 accumulators of 32 registers).
 *   AVX2: 6 rows x 16 columns (12 of 16 registers), the panel in two halves; up to
 *   four rows, whole panels two rows at a time (a sequential stream, as the GEMV reads).
 * Products accumulate in fp32 in k order; elsewhere gemm_f32_available() is 0 and
 * linear.py keeps the GEMV and the library GEMM.
 *
 *   x [M, K] row-major fp32, y [M, N] row-major fp32; needs N % 32 == 0.
 */
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GN 32 /* output columns per panel */

int gemm_f32_available(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
#define MR 12
#define COLS GN /* columns a tile covers */
/* One tile: mr rows of x against one panel, into out[mr][GN]. */
static inline __attribute__((always_inline)) void tile(
    const float *x, long ldx, const float *panel, int K, float out[MR][GN], int mr) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++, panel += GN) {
        const __m512 w0 = _mm512_loadu_ps(panel), w1 = _mm512_loadu_ps(panel + 16);
        for (int r = 0; r < mr; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + 16, acc[r][1]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define MR 6
#define COLS 16
/* One tile: mr rows of x against half a panel (16 columns from `panel`), into out. */
static inline __attribute__((always_inline)) void tile(
    const float *x, long ldx, const float *panel, int K, float out[MR][GN], int mr) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++, panel += GN) {
        const __m256 w0 = _mm256_loadu_ps(panel), w1 = _mm256_loadu_ps(panel + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__) && defined(__FMA__)
#define WIDE_ROWS 4 /* up to this many rows: whole panels, two rows at a time */
/* A tile of one or two rows against a whole panel: with few rows the step reads W from
 * memory, and a panel read in two strided halves ran at about 60% of the GEMV's rate at
 * one row; read whole it is one sequential stream. */
static inline __attribute__((always_inline)) void tile_wide(
    const float *x, long ldx, const float *panel, int K, float out[MR][GN], int mr) {
    __m256 acc[2][4];
    for (int r = 0; r < 2; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++, panel += GN) {
        __m256 wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm256_loadu_ps(panel + 8 * j);
        for (int r = 0; r < mr; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(xb, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out[r] + 8 * j, acc[r][j]);
}

/* All of y's columns in panel p for rows m0.. (at most WIDE_ROWS of them). */
static void panel_wide(const float *x, const float *panel, const float *bias, float *y, int M,
                       int N, int K, int p) {
    float out[MR][GN];
    for (int m0 = 0; m0 < M; m0 += 2) {
        if (M - m0 >= 2) tile_wide(x + (long)m0 * K, K, panel, K, out, 2);
        else tile_wide(x + (long)m0 * K, K, panel, K, out, 1);
        for (int r = 0; r < 2 && m0 + r < M; r++) {
            float *row = y + (long)(m0 + r) * N + (long)p * GN;
            for (int j = 0; j < GN; j++) row[j] = out[r][j] + (bias ? bias[p * GN + j] : 0.f);
        }
    }
}
#endif

#if defined(MR)
/* The switch hands tile() a constant row count, so its loops unroll and the
 * accumulators stay in registers. */
static void tile_any(const float *x, long ldx, const float *panel, int K, float out[MR][GN],
                     int mr) {
    switch (mr) {
#define CASE(n) case n: tile(x, ldx, panel, K, out, n); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5)
#if MR > 6
        CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
#endif
        default: tile(x, ldx, panel, K, out, MR); break;
#undef CASE
    }
}
#endif

int gemm_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
             int nt) {
#if defined(MR)
    if (N % GN != 0) return -1;
    const int panels = N / GN;
    #pragma omp parallel for schedule(static) num_threads(nt) if (panels > 1)
    for (int p = 0; p < panels; p++) {
#if defined(WIDE_ROWS)
        if (M <= WIDE_ROWS) {
            panel_wide(x, w + (long)p * K * GN, bias, y, M, N, K, p);
            continue;
        }
#endif
        float out[MR][GN];
        for (int c0 = 0; c0 < GN; c0 += COLS) {  /* AVX2: the panel's two halves */
            const float *panel = w + (long)p * K * GN + c0;
            for (int m0 = 0; m0 < M; m0 += MR) {
                const int mr = M - m0 < MR ? M - m0 : MR;
                tile_any(x + (long)m0 * K, K, panel, K, out, mr);
                for (int r = 0; r < mr; r++) {
                    float *row = y + (long)(m0 + r) * N + (long)p * GN + c0;
                    for (int j = 0; j < COLS; j++)
                        row[j] = out[r][j] + (bias ? bias[p * GN + c0 + j] : 0.f);
                }
            }
        }
    }
    return 0;
#else
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nt;
    return -1;
#endif
}
