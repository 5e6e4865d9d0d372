/* y = x W^T in bf16 for a batch of rows (a decode step of many sequences, a prefill chunk),
 * with the AVX-512 BF16 dot-product instruction.
 *
 * Why: without AMX, oneDNN's bf16 GEMM ran at 120-180 GFLOP/s here at 32 rows (the
 * machine's bf16 peak is about 900), and the lm_head alone took a third of a 32-sequence
 * decode step. The GEMV (gemv.c) is built for a few rows: it reduces each output across K
 * inside a vector, so every output ends in a horizontal sum, and its 4x4 tile reuses each
 * load only four times.
 *
 * This is the usual register-tiled micro-kernel instead. W is packed once (pack_gemm_bf16
 * in linear.py) into panels of GN=32 output columns, K in pairs, as VDPBF16PS reads them:
 *     packed[N/GN][K/2][GN][2]
 * so one panel is one sequential stream. For a tile of up to MR=12 rows of x, each step
 * over a K pair loads the panel's two vectors (32 columns x 2 k) once, broadcasts each
 * row's (x[k], x[k+1]) pair, and issues 2*MR dot products into 24 accumulators that stay in
 * registers; no horizontal sums. Threads split the panels, so each reads its part of W
 * from memory once and the tiles of x after the first re-read it from cache.
 *
 * Products accumulate in fp32 and round to bf16 once at the end (round to nearest even,
 * as torch does), like oneDNN. Only built where the compiler targets AVX512_BF16; elsewhere
 * gemm_bf16_available() is 0 and linear.py does not pack for it.
 *
 *   x [M, K] row-major bf16 (uint16), y [M, N] row-major bf16; needs N % 32 == 0, K even.
 */
#include <stdint.h>

#include "common.h"

#define GN 32 /* output columns per panel: two vectors of 16 fp32 accumulators */
#define MR 12 /* rows of x per tile: 2 * 12 accumulators + 2 weights + 1 broadcast <= 32 */

int gemm_bf16_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* One tile: mr rows of x against one panel, into out[mr][GN] (fp32). */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, long ldx, const uint16_t *panel, int K, float out[MR][GN], int mr) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 2, panel += 2 * GN) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + GN);
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + k, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + 16, acc[r][1]);
    }
}

/* The switch hands tile() a constant row count, so its loops unroll and the
 * accumulators stay in registers. */
static void tile_any(const uint16_t *x, long ldx, const uint16_t *panel, int K,
                     float out[MR][GN], int mr) {
    switch (mr) {
#define CASE(n) case n: tile(x, ldx, panel, K, out, n); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
        CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
        default: tile(x, ldx, panel, K, out, MR); break;
#undef CASE
    }
}
#endif

int gemm_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
              int M, int N, int K, int nt) {
#if defined(__AVX512BF16__)
    if (N % GN != 0 || K % 2 != 0) return -1;
    const int panels = N / GN;
    #pragma omp parallel for schedule(static) num_threads(nt) if (panels > 1)
    for (int p = 0; p < panels; p++) {
        const uint16_t *panel = w + (long)p * K * GN;
        float out[MR][GN];
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? M - m0 : MR;
            tile_any(x + (long)m0 * K, K, panel, K, out, mr);
            for (int r = 0; r < mr; r++) {
                uint16_t *row = y + (long)(m0 + r) * N + (long)p * GN;
                for (int j = 0; j < GN; j++)
                    row[j] = f2bf(out[r][j] + (bias ? bias[p * GN + j] : 0.f));
            }
        }
    }
    return 0;
#else
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nt;
    return -1;
#endif
}
