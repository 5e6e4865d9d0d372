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
 * compiler's macros (__AVX512BF16__, __AVX512VNNI__, __AVX512F__, __AVX2__), and a plain
 * C path covers every other CPU (aarch64 included: the compiler vectorizes it).
 *
 *   x [M, K] row-major, y [M, N] row-major; needs K % 64 == 0 and N % NB == 0.
 *   bf16: x, W, y bf16 (uint16).  f32: all fp32.
 *   i8: x quantized per row (int8 and one fp32 scale per row, quantize_rows in ops.c), W
 *       int8 with one fp32 scale per output row. int32 accumulation is exact, so this
 *       kernel and torch._int_mm (used for larger M) give the same bits.
 */
#include <stdint.h>
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
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = _mm512_reduce_add_ps(a[m][j]);
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
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = _mm512_reduce_add_ps(a[m][j]);
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
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = _mm512_reduce_add_ps(a[m][j]);
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

/* -------------------------------------------------------------------- int8 x int8 */
#define CH_I8 64
static inline __attribute__((always_inline)) void i8_block(
    const int8_t *x, const int8_t *w, int32_t acc[MB][NB], int mb, int K) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* vpdpbusd multiplies unsigned by signed bytes: feed |x|, and w with x's sign. */
    __m512i a[MB][NB];
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm512_setzero_si512();
    for (int k = 0; k < K; k += CH_I8, w += NB * CH_I8) {
        PREFETCH_BLOCK(w);
        __m512i wv[NB];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_si512(w + j * CH_I8);
        for (int m = 0; m < mb; m++) {
            const __m512i xv = _mm512_loadu_si512(x + (long)m * K + k);
            const __m512i ax = _mm512_abs_epi8(xv);
            const __mmask64 neg = _mm512_movepi8_mask(xv);
            for (int j = 0; j < NB; j++) {
                const __m512i sw = _mm512_mask_sub_epi8(wv[j], neg, _mm512_setzero_si512(), wv[j]);
                a[m][j] = _mm512_dpbusd_epi32(a[m][j], ax, sw);
            }
        }
    }
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = _mm512_reduce_add_epi32(a[m][j]);
#elif defined(__AVX2__)
    /* maddubs: |x| (u8) times w with x's sign (s8), pairs summed into int16 (no pair can
     * saturate, since |x|, |w| <= 127), then madd with ones widens to int32: exact. */
    __m256i a[MB][NB];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MB; m++) for (int j = 0; j < NB; j++) a[m][j] = _mm256_setzero_si256();
    for (int k = 0; k < K; k += CH_I8, w += NB * CH_I8) {
        PREFETCH_BLOCK(w);
        for (int h = 0; h < CH_I8; h += 32) {
            __m256i wv[NB];
            for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_si256((const __m256i *)(w + j * CH_I8 + h));
            for (int m = 0; m < mb; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + (long)m * K + k + h));
                const __m256i ax = _mm256_sign_epi8(xv, xv);
                for (int j = 0; j < NB; j++) {
                    const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xv));
                    a[m][j] = _mm256_add_epi32(a[m][j], _mm256_madd_epi16(p, ones));
                }
            }
        }
    }
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = hsum256_epi32(a[m][j]);
#else
    for (int m = 0; m < mb; m++) for (int j = 0; j < NB; j++) acc[m][j] = 0;
    for (int k = 0; k < K; k += CH_I8, w += NB * CH_I8) {
        PREFETCH_BLOCK(w);
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < NB; j++) {
                int32_t s = 0;
                for (int c = 0; c < CH_I8; c++)
                    s += (int32_t)x[(long)m * K + k + c] * (int32_t)w[j * CH_I8 + c];
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
DEFINE_ANY(i8, int8_t, int8_t, int32_t)

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

int gemv_i8(const int8_t *xq, const float *sx, const int8_t *w, const float *sw,
            const float *bias, void *y, int y_bf16, int M, int N, int K, int nt) {
    if (unsupported(N, K)) return -1;
    #pragma omp parallel for schedule(static) num_threads(nt) if (N > 64)
    for (int b = 0; b < N / NB; b++) {
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            int32_t acc[MB][NB];
            i8_any(xq + (long)m0 * K, w + (long)b * NB * K, acc, mb, K);
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < NB; j++) {
                    const int n = b * NB + j;
                    const long i = (long)(m0 + m) * N + n;
                    const float v = dequant(acc[m][j], sx[m0 + m], sw[n], bias ? bias[n] : 0.f);
                    if (y_bf16) ((uint16_t *)y)[i] = f2bf(v);
                    else ((float *)y)[i] = v;
                }
        }
    }
    return 0;
}
