/* y = x W^T for a few rows of x: matrix-vector products that stream W once.
 *
 * Why: a decode step multiplies one to a few token rows by every weight matrix, so its
 * cost is reading the weights. The BLAS kernels are tuned for bigger shapes: at one row,
 * bf16 reached about half of the memory bandwidth here, and int8 has no fast CPU path
 * at these shapes.
 *
 * W is packed once, at load time (pack_rows in linear.py), so that each thread reads one
 * strictly sequential stream: blocks of NB=4 output rows, and inside a block, 64-byte
 * chunks of the four rows one after the other:
 *     packed[N/NB][K/CH][NB][CH],  CH = 64 bytes / element size.
 * Reading four rows side by side instead (four streams per thread) ran at about 65% of
 * a plain read loop. Each thread owns a range of blocks and computes them for every row
 * of x (MB=4 rows at a time), so W is read from memory once per call and four output
 * rows keep four independent chains in the FMA units.
 *
 * Built with -march for the CPU it runs on (kernels.py); the intrinsics used follow the
 * compiler's macros (__AVX512BF16__, __AVX512F__, __AVX2__), and a plain
 * C path covers every other CPU (aarch64 included: the compiler vectorizes it).
 *
 *   x [M, K] row-major, y [M, N] row-major; needs K % 64 == 0 and N % NB == 0.
 *   bf16: x, W, y bf16 (uint16).  f32: all fp32.
 *   i8: W int8 with one fp32 scale per output row; x and y fp32 or bf16 (weight-only:
 *       activations keep their precision; the products accumulate in fp32).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

#define NB 4 /* output rows per block */
#define MB 4 /* rows of x per pass over a block */
/* Prefetch W this far ahead of the block being read. The hardware prefetcher alone left
 * each core at about 77% of a plain read loop's rate; 4 KiB ahead closed the gap. */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif
#define PREFETCH_BLOCK(p) do { for (int l_ = 0; l_ < NB; l_++) \
    __builtin_prefetch((const char *)(p) + PF_BYTES + 64 * l_, 0, 3); } while (0)

#if defined(__AVX512F__)
/* acc[m][j] = the sum of a[m][j]'s 16 lanes, for a full 4 x 4 tile. The sixteen sums are
 * formed together, the vectors transposed as they are added (45 instructions, not 16
 * reductions of 8 to 10 each): at 8 to 32 rows that epilogue cost the fp32 GEMV about a
 * quarter of its time. The pairs are added in _mm512_reduce_add_ps's order (halves, then
 * quarters, then within a 128-bit lane), so every sum is bit for bit what it gives. */
static inline __attribute__((always_inline)) void reduce_tile(__m512 a[MB][NB],
                                                             float acc[MB][NB]) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++) {  /* v = a[i/2 ...] flattened as m * NB + j */
        const __m512 u = a[(2 * i) / NB][(2 * i) % NB], v = a[(2 * i + 1) / NB][(2 * i + 1) % NB];
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x44), _mm512_shuffle_f32x4(u, v, 0xEE));
    }
    for (int k = 0; k < 4; k++)
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
    const __m512 r0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
    const __m512 r1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(r0), _mm512_castps_pd(r1));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(r0), _mm512_castps_pd(r1));
    float out[16];  /* out[4 * L + e] is the sum of vector 4 * e + L */
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)));
    for (int v = 0; v < MB * NB; v++) acc[v / NB][v % NB] = out[4 * (v % 4) + v / 4];
}

/* The tile's sums: all sixteen at once where the tile is full. */
static inline __attribute__((always_inline)) void reduce_rows(__m512 a[MB][NB],
                                                             float acc[MB][NB], int mb) {
    if (mb == MB && NB == 4) { reduce_tile(a, acc); return; }
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = _mm512_reduce_add_ps(a[m][j]);
}
#endif

/* -------------------------------------------------------------------- bf16 x bf16 */
#define CH_BF16 32
static inline __attribute__((always_inline)) void bf16_block(
    const uint16_t *x, const uint16_t *w, float acc[MB][NB], int mb, int K) {
#if defined(__AVX512BF16__)
    __m512 a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += CH_BF16, w += NB * CH_BF16) {
        PREFETCH_BLOCK(w);
        __m512bh wv[NB];
        for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * CH_BF16);
        for (int m = 0; m < mb; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (long)m * K + k);
            for (int j = 0; j < NB; j++) a[m][j] = _mm512_dpbf16_ps(a[m][j], xv, wv[j]);
        }
    }
    reduce_rows(a, acc, mb);
#elif defined(__AVX512F__)
#define CVT16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32( \
        _mm256_loadu_si256((const __m256i *)(p))), 16))
    __m512 a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += CH_BF16, w += NB * CH_BF16) {
        PREFETCH_BLOCK(w);
        for (int h = 0; h < CH_BF16; h += 16) {
            __m512 wv[NB];
            for (int j = 0; j < NB; j++) wv[j] = CVT16(w + j * CH_BF16 + h);
            for (int m = 0; m < mb; m++) {
                const __m512 xv = CVT16(x + (long)m * K + k + h);
                for (int j = 0; j < NB; j++) a[m][j] = _mm512_fmadd_ps(xv, wv[j], a[m][j]);
            }
        }
    }
    reduce_rows(a, acc, mb);
#undef CVT16
#elif defined(__AVX2__) && defined(__FMA__)
#define CVT8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32( \
        _mm_loadu_si128((const __m128i *)(p))), 16))
    __m256 a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += CH_BF16, w += NB * CH_BF16) {
        PREFETCH_BLOCK(w);
        for (int h = 0; h < CH_BF16; h += 8) {
            __m256 wv[NB];
            for (int j = 0; j < NB; j++) wv[j] = CVT8(w + j * CH_BF16 + h);
            for (int m = 0; m < mb; m++) {
                const __m256 xv = CVT8(x + (long)m * K + k + h);
                for (int j = 0; j < NB; j++) a[m][j] = _mm256_fmadd_ps(xv, wv[j], a[m][j]);
            }
        }
    }
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = hsum256(a[m][j]);
#undef CVT8
#else
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = 0.f;
    for (int k = 0; k < K; k += CH_BF16, w += NB * CH_BF16) {
        PREFETCH_BLOCK(w);
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < NB; j++) {
                float s = 0.f;
                for (int c = 0; c < CH_BF16; c++)
                    s += bf2f(x[(long)m * K + k + c]) * bf2f(w[j * CH_BF16 + c]);
                acc[m][j] += s;
            }
    }
#endif
}

/* -------------------------------------------------------------------- fp32 x fp32 */
#define CH_F32 16
static inline __attribute__((always_inline)) void f32_block(
    const float *x, const float *w, float acc[MB][NB], int mb, int K) {
#if defined(__AVX512F__)
    __m512 a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += CH_F32, w += NB * CH_F32) {
        PREFETCH_BLOCK(w);
        __m512 wv[NB];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_ps(w + j * CH_F32);
        for (int m = 0; m < mb; m++) {
            const __m512 xv = _mm512_loadu_ps(x + (long)m * K + k);
            for (int j = 0; j < NB; j++) a[m][j] = _mm512_fmadd_ps(xv, wv[j], a[m][j]);
        }
    }
    reduce_rows(a, acc, mb);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += CH_F32, w += NB * CH_F32) {
        PREFETCH_BLOCK(w);
        for (int h = 0; h < CH_F32; h += 8) {
            __m256 wv[NB];
            for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(w + j * CH_F32 + h);
            for (int m = 0; m < mb; m++) {
                const __m256 xv = _mm256_loadu_ps(x + (long)m * K + k + h);
                for (int j = 0; j < NB; j++) a[m][j] = _mm256_fmadd_ps(xv, wv[j], a[m][j]);
            }
        }
    }
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = hsum256(a[m][j]);
#else
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = 0.f;
    for (int k = 0; k < K; k += CH_F32, w += NB * CH_F32) {
        PREFETCH_BLOCK(w);
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < NB; j++) {
                float s = 0.f;
                for (int c = 0; c < CH_F32; c++) s += x[(long)m * K + k + c] * w[j * CH_F32 + c];
                acc[m][j] += s;
            }
    }
#endif
}

/* ------------------------------------------------- int8 weights x fp32 activations */
/* x is converted to fp32 once per call (to_f32_rows); each 64-byte chunk of int8 weights
 * widens to four vectors of fp32 and meets every row of x in FMAs. The per-row scale of W
 * multiplies the sum at the end. */
#define CH_I8 64
static inline __attribute__((always_inline)) void i8_block(
    const float *x, const int8_t *w, float acc[MB][NB], int mb, int K) {
#if defined(__AVX512F__)
    __m512 a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += CH_I8, w += NB * CH_I8) {
        PREFETCH_BLOCK(w);
        for (int h = 0; h < CH_I8; h += 16) {
            __m512 wv[NB];
            for (int j = 0; j < NB; j++)
                wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(w + j * CH_I8 + h))));
            for (int m = 0; m < mb; m++) {
                const __m512 xv = _mm512_loadu_ps(x + (long)m * K + k + h);
                for (int j = 0; j < NB; j++) a[m][j] = _mm512_fmadd_ps(xv, wv[j], a[m][j]);
            }
        }
    }
    reduce_rows(a, acc, mb);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += CH_I8, w += NB * CH_I8) {
        PREFETCH_BLOCK(w);
        for (int h = 0; h < CH_I8; h += 8) {
            __m256 wv[NB];
            for (int j = 0; j < NB; j++)
                wv[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(w + j * CH_I8 + h))));
            for (int m = 0; m < mb; m++) {
                const __m256 xv = _mm256_loadu_ps(x + (long)m * K + k + h);
                for (int j = 0; j < NB; j++) a[m][j] = _mm256_fmadd_ps(xv, wv[j], a[m][j]);
            }
        }
    }
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = hsum256(a[m][j]);
#else
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = 0.f;
    for (int k = 0; k < K; k += CH_I8, w += NB * CH_I8) {
        PREFETCH_BLOCK(w);
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < NB; j++) {
                float s = 0.f;
                for (int c = 0; c < CH_I8; c++) s += x[(long)m * K + k + c] * (float)w[j * CH_I8 + c];
                acc[m][j] += s;
            }
    }
#endif
}

/* ------------------------------------------------------------------ the three drivers
 * Blocks are split over threads. The switch on mb hands the block kernels a constant, so
 * their accumulators stay in registers. */
#define DEFINE_ANY(NAME, XT, WT, AT)                                                         \
static inline void NAME##_any(const XT *x, const WT *w, AT acc[MB][NB], int mb, int K) {    \
    switch (mb) {                                                                            \
        case 1: NAME##_block(x, w, acc, 1, K); break;                                        \
        case 2: NAME##_block(x, w, acc, 2, K); break;                                        \
        case 3: NAME##_block(x, w, acc, 3, K); break;                                        \
        default: NAME##_block(x, w, acc, 4, K); break;                                       \
    }                                                                                        \
}
DEFINE_ANY(bf16, uint16_t, uint16_t, float)
DEFINE_ANY(f32, float, float, float)
DEFINE_ANY(i8, float, int8_t, float)

static inline int unsupported(int N, int K) { return N % NB != 0 || K % 64 != 0; }

int gemv_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
              int M, int N, int K, int nt) {
    if (unsupported(N, K)) return -1;
    #pragma omp parallel for schedule(static) num_threads(nt) if (N > 64)
    for (int b = 0; b < N / NB; b++) {
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            float acc[MB][NB];
            bf16_any(x + (long)m0 * K, w + (long)b * NB * K, acc, mb, K);
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < NB; j++) {
                    const int n = b * NB + j;
                    y[(long)(m0 + m) * N + n] = f2bf(acc[m][j] + (bias ? bias[n] : 0.f));
                }
        }
    }
    return 0;
}

int gemv_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
             int nt) {
    if (unsupported(N, K)) return -1;
    #pragma omp parallel for schedule(static) num_threads(nt) if (N > 64)
    for (int b = 0; b < N / NB; b++) {
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            float acc[MB][NB];
            f32_any(x + (long)m0 * K, w + (long)b * NB * K, acc, mb, K);
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < NB; j++) {
                    const int n = b * NB + j;
                    y[(long)(m0 + m) * N + n] = acc[m][j] + (bias ? bias[n] : 0.f);
                }
        }
    }
    return 0;
}

int gemv_i8(const void *x, int x_bf16, const int8_t *w, const float *sw, const float *bias,
            void *y, int M, int N, int K, int nt) {
    if (unsupported(N, K)) return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)M * K);
    if (!xf) return -2;
    if (x_bf16)
        for (long i = 0; i < (long)M * K; i++) xf[i] = bf2f(((const uint16_t *)x)[i]);
    else
        memcpy(xf, x, sizeof(float) * (size_t)M * K);
    #pragma omp parallel for schedule(static) num_threads(nt) if (N > 64)
    for (int b = 0; b < N / NB; b++) {
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            float acc[MB][NB];
            i8_any(xf + (long)m0 * K, w + (long)b * NB * K, acc, mb, K);
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < NB; j++) {
                    const int n = b * NB + j;
                    const long i = (long)(m0 + m) * N + n;
                    const float v = acc[m][j] * sw[n] + (bias ? bias[n] : 0.f);
                    if (x_bf16) ((uint16_t *)y)[i] = f2bf(v);
                    else ((float *)y)[i] = v;
                }
        }
    }
    free(xf);
    return 0;
}
