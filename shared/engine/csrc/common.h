/* Helpers shared by the kernels: bf16 conversion (round to nearest even, as torch does),
 * a vectorizable exp, horizontal sums. */
#ifndef HALFMOON_COMMON_H
#define HALFMOON_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Branch-free and punned through memcpy, so loops that call these vectorize. */
static inline float bf2f(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* x rounded to bf16 and back: what a bf16 tensor holds after torch writes x into it. */
static inline float round_bf16(float x) { return bf2f(f2bf(x)); }

/* exp(x), vectorizable (glibc's expf is scalar here): 2^(x log2 e) split into 2^i * 2^f,
 * 2^f by a degree-5 polynomial; relative error about 2e-7 (two ulps). x is clamped to
 * [-87, 88], where expf neither overflows nor goes subnormal. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float t = x * 1.44269504089f;
    const float fi = floorf(t);
    const float f = t - fi;
    float p = 1.8775767e-3f;
    p = p * f + 8.9893397e-3f;
    p = p * f + 5.5826318e-2f;
    p = p * f + 2.4015361e-1f;
    p = p * f + 6.9315308e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int)fi + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX2__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* exp_approx for x <= 0, 8 lanes. */
static inline __m256 exp256_nonpos(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f));
    const __m256 fi = _mm256_floor_ps(t);
    const __m256 f = _mm256_sub_ps(t, fi);
    __m256 p = _mm256_set1_ps(1.8775767e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.9893397e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5826318e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4015361e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9315308e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__)
/* exp_approx for x <= 0, 16 lanes (scores less their running max). */
static inline __m512 exp512_nonpos(__m512 x) {  /* exp_nonpos, 16 lanes */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(1.8775767e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.9893397e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5826318e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015361e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315308e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif
#endif
