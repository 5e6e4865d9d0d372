/* The decode step's small ops for CPUs, each one pass over memory instead of several.
 *
 * Why: a decode step of a small model is a few hundred tiny ops; in eager torch each one
 * allocates, dispatches and walks memory on its own, and together they cost as much as
 * the matmuls. And at one to a few rows, a matmul is a matrix-vector product that only
 * has to stream its weights once: the BLAS kernels here are built for bigger shapes and
 * leave bandwidth on the table (bf16 reached about half of it, int8 has none on AVX2).
 *
 * Plain C, vectorized by the compiler for the CPU it is built on (-march chosen at run
 * time from the CPU, see kernels.py), parallel with the OpenMP runtime torch itself loads.
 *
 * Activations ("act") are fp32 or bf16 (uint16) row-major; `bf16` flags say which. bf16
 * results are rounded to nearest even, as torch rounds them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static inline float load(const void *p, long i, int bf16) {
    return bf16 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, long i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f2bf(x);
    else ((float *)p)[i] = x;
}

/* ---- RMSNorm, with the residual add fused in ----------------------------------------
 * If `delta` is given: h += delta first (h rounded to its dtype, as torch's add is).
 * Then out = weight * round(h * rsqrt(mean(h^2) + eps)), transformers' LlamaRMSNorm:
 * the normalized row is rounded to the activation dtype before the weight multiplies it.
 * One function per dtype, each loop plain enough to vectorize. */
static void rms_row_f32(float *h, const float *delta, const float *w, float *out, int dim,
                        float eps) {
    float ss = 0.f;
    if (delta) {
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < dim; i++) { const float v = h[i] + delta[i]; h[i] = v; ss += v * v; }
    } else {
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < dim; i++) ss += h[i] * h[i];
    }
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    #pragma omp simd
    for (int i = 0; i < dim; i++) out[i] = w[i] * (h[i] * inv);
}

static void rms_row_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                         int dim, float eps) {
    float ss = 0.f;
    if (delta) {
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < dim; i++) {
            const uint16_t v = f2bf(bf2f(h[i]) + bf2f(delta[i]));
            h[i] = v;
            ss += bf2f(v) * bf2f(v);
        }
    } else {
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < dim; i++) ss += bf2f(h[i]) * bf2f(h[i]);
    }
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    #pragma omp simd
    for (int i = 0; i < dim; i++) out[i] = f2bf(bf2f(w[i]) * round_bf16(bf2f(h[i]) * inv));
}

void rms_norm(void *h, const void *delta, const void *weight, void *out, int rows, int dim,
              float eps, int bf16, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 4)
    for (int r = 0; r < rows; r++) {
        const long off = (long)r * dim;
        if (bf16)
            rms_row_bf16((uint16_t *)h + off, delta ? (const uint16_t *)delta + off : NULL,
                         (const uint16_t *)weight, (uint16_t *)out + off, dim, eps);
        else
            rms_row_f32((float *)h + off, delta ? (const float *)delta + off : NULL,
                        (const float *)weight, (float *)out + off, dim, eps);
    }
}

/* ---- RMSNorm of each q and k head in place (Qwen3's q_norm and k_norm) -------------
 * qkv rows are [q heads | k heads | v heads], `stride` elements apart; every q head is
 * normalized with q_weight [head_dim], every k head with k_weight, before RoPE, with
 * the same arithmetic as the rows above (in place: each element is read before written). */
void head_rms_norm(void *qkv, long stride, int rows, int num_q_heads, int num_kv_heads,
                   int head_dim, const void *q_weight, const void *k_weight, float eps,
                   int bf16, int num_threads) {
    const int heads = num_q_heads + num_kv_heads;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (rows > 4)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const long off = (long)r * stride + (long)h * head_dim;
            const void *w = h < num_q_heads ? q_weight : k_weight;
            if (bf16)
                rms_row_bf16((uint16_t *)qkv + off, NULL, (const uint16_t *)w,
                             (uint16_t *)qkv + off, head_dim, eps);
            else
                rms_row_f32((float *)qkv + off, NULL, (const float *)w, (float *)qkv + off,
                            head_dim, eps);
        }
}

/* ---- h += delta (the MLP's residual add), rounded to the dtype ----------------------- */
void add_inplace(void *h, const void *delta, long n, int bf16, int num_threads) {
    if (bf16) {
        uint16_t *a = (uint16_t *)h;
        const uint16_t *b = (const uint16_t *)delta;
        #pragma omp parallel for simd schedule(static) num_threads(num_threads) if (n > 65536)
        for (long i = 0; i < n; i++) a[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
    } else {
        float *a = (float *)h;
        const float *b = (const float *)delta;
        #pragma omp parallel for simd schedule(static) num_threads(num_threads) if (n > 65536)
        for (long i = 0; i < n; i++) a[i] += b[i];
    }
}

/* ---- out = silu(gate) * up, where gate_up rows are [gate | up] ----------------------
 * As torch computes it: silu rounded to the dtype, then the product rounded. */
static void silu_row_bf16(const uint16_t *restrict g, const uint16_t *restrict u,
                          uint16_t *restrict o, int n) {
    float x[256], y[256];  /* in chunks: three plain loops vectorize where one fused did not */
    for (int i0 = 0; i0 < n; i0 += 256) {
        const int len = n - i0 < 256 ? n - i0 : 256;
        #pragma omp simd
        for (int i = 0; i < len; i++) x[i] = bf2f(g[i0 + i]);
        #pragma omp simd
        for (int i = 0; i < len; i++) y[i] = round_bf16(x[i] / (1.f + exp_approx(-x[i])));
        #pragma omp simd
        for (int i = 0; i < len; i++) o[i0 + i] = f2bf(y[i] * bf2f(u[i0 + i]));
    }
}

static void silu_row_f32(const float *restrict g, const float *restrict u, float *restrict o,
                         int n) {
    #pragma omp simd
    for (int i = 0; i < n; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
}

void silu_mul(const void *gate_up, void *out, int rows, int inter, int bf16, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 4)
    for (int r = 0; r < rows; r++) {
        const long gi = (long)r * 2 * inter, oi = (long)r * inter;
        if (bf16)
            silu_row_bf16((const uint16_t *)gate_up + gi, (const uint16_t *)gate_up + gi + inter,
                          (uint16_t *)out + oi, inter);
        else
            silu_row_f32((const float *)gate_up + gi, (const float *)gate_up + gi + inter,
                         (float *)out + oi, inter);
    }
}

/* ---- RoPE on q and k in place, then k and v into their paged-cache slots -------------
 * qkv rows are [q heads | k heads | v heads]; cos/sin are fp32 tables [positions,
 * head_dim] in transformers' rotate-half layout (already rounded to the activation dtype,
 * as transformers casts them), row r uses table row positions[r]. Each product and sum is
 * rounded to the dtype as torch's q * cos + rotate_half(q) * sin is.
 * k cache [blocks, kv_heads, head_dim, block_size], v cache [blocks, kv_heads, block_size,
 * head_dim] (see kv_cache.py); slot i goes to (blocks[i], offsets[i]). */
void rope_kv_write(void *qkv, const float *cos, const float *sin, const int64_t *positions,
                   int rows, int num_q_heads,
                   int num_kv_heads, int head_dim, const int64_t *blocks,
                   const int64_t *offsets, void *k_cache, void *v_cache, int block_size,
                   int bf16, int num_threads) {
    const int width = (num_q_heads + 2 * num_kv_heads) * head_dim, half = head_dim / 2;
    const long head_stride = (long)head_dim * block_size;
    const long block_stride = head_stride * num_kv_heads;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int r = 0; r < rows; r++) {
        const float *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        for (int h = 0; h < num_q_heads + num_kv_heads; h++) {
            const long base = (long)r * width + (long)h * head_dim;
            float x[512], y[512];
            if (head_dim > 512) continue;
            for (int d = 0; d < head_dim; d++) x[d] = load(qkv, base + d, bf16);
            for (int d = 0; d < head_dim; d++) {
                const float rot = d < half ? -x[d + half] : x[d - half];
                float a = x[d] * c[d], b = rot * s[d];
                if (bf16) { a = bf2f(f2bf(a)); b = bf2f(f2bf(b)); }
                y[d] = a + b;
            }
            for (int d = 0; d < head_dim; d++) store(qkv, base + d, y[d], bf16);
        }
        const long blk = (long)blocks[r] * block_stride, off = offsets[r];
        for (int h = 0; h < num_kv_heads; h++) {
            const long kbase = (long)r * width + (long)(num_q_heads + h) * head_dim;
            const long vbase = kbase + (long)num_kv_heads * head_dim;
            const long cbase = blk + (long)h * head_stride;
            if (bf16) {
                const uint16_t *src = (const uint16_t *)qkv;
                uint16_t *kc = (uint16_t *)k_cache, *vc = (uint16_t *)v_cache;
                for (int d = 0; d < head_dim; d++) kc[cbase + (long)d * block_size + off] = src[kbase + d];
                memcpy(vc + cbase + off * head_dim, src + vbase, 2 * head_dim);
            } else {
                const float *src = (const float *)qkv;
                float *kc = (float *)k_cache, *vc = (float *)v_cache;
                for (int d = 0; d < head_dim; d++) kc[cbase + (long)d * block_size + off] = src[kbase + d];
                memcpy(vc + cbase + off * head_dim, src + vbase, 4 * head_dim);
            }
        }
    }
}

/* ---- memory read bandwidth: sum a buffer (for the benchmark's roofline) --------------
 * With the same software prefetch as the GEMV, so the bound is what a tuned stream gets. */
double read_bandwidth_sum(const float *buf, long n, int num_threads) {
    double total = 0.0;
    #pragma omp parallel for reduction(+:total) schedule(static) num_threads(num_threads)
    for (long i0 = 0; i0 < n; i0 += 4096) {
        const long end = i0 + 4096 < n ? i0 + 4096 : n;
        for (long p = i0; p < end; p += 16) __builtin_prefetch(buf + p + 4096, 0, 3);
        float a = 0.f;
        #pragma omp simd reduction(+:a)
        for (long i = i0; i < end; i++) a += buf[i];
        total += a;
    }
    return total;
}
