/* Paged decode attention for CPUs: one query token per sequence, KV read in place.
 *
 * Why C: torch has no paged attention on CPU; gathering every sequence's blocks into a
 * dense tensor each step costs more memory traffic than the attention itself. This reads
 * each sequence's blocks straight from the pool through its block table, keeps scores in
 * fp32 with a per-block online softmax, and parallelises over (sequence, kv head).
 *
 * Layouts (row-major). K is stored transposed inside a block so that q.K for all of a
 * block's tokens is a run of vector FMAs over tokens, with no horizontal sums:
 *   q            [num_seqs, num_q_heads, head_dim]                fp32
 *   k cache      [num_blocks, num_kv_heads, head_dim, block_size]  bf16 (uint16) or fp32
 *   v cache      [num_blocks, num_kv_heads, block_size, head_dim]  same dtype
 *   block_tables [num_seqs, max_blocks]                            int32
 *   ctx_lens     [num_seqs]                                        int32 (tokens to attend)
 *   out          [num_seqs, num_q_heads, head_dim]                fp32
 * Query heads h*G .. h*G+G-1 share kv head h (grouped-query attention).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

/* exp(x) for x <= 0, vectorizable (glibc's expf is scalar).
 * 2^(x log2 e) split into 2^i * 2^f, 2^f by a degree-5 polynomial: relative error ~2e-7. */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.44269504089f;
    const float fi = floorf(t);
    const float f = t - fi;
    float p = 1.8775767e-3f;
    p = p * f + 8.9893397e-3f;
    p = p * f + 5.5826318e-2f;
    p = p * f + 2.4015361e-1f;
    p = p * f + 6.9315308e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)((int)fi + 127) << 23;
    return p * v.f;
}

#define DEFINE_KERNEL(NAME, T, LOAD)                                                          \
static inline __attribute__((always_inline)) void NAME##_one(const float *q, const T *k_cache, const T *v_cache,                   \
                       const int32_t *table, int len, int s, int h, int G, int num_q_heads,   \
                       int head_dim, int block_size, long block_stride, long head_stride,     \
                       float scale, float *out) {                                             \
    float qv[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM];                                   \
    float m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP][MAX_BLOCK], row[MAX_DIM > MAX_BLOCK ?    \
                                                                    MAX_DIM : MAX_BLOCK];    \
    for (int g = 0; g < G; g++) {                                                            \
        const float *src = q + ((long)s * num_q_heads + h * G + g) * head_dim;               \
        for (int d = 0; d < head_dim; d++) qv[g][d] = src[d] * scale;                        \
        memset(acc[g], 0, sizeof(float) * head_dim);                                         \
        m[g] = -INFINITY; l[g] = 0.f;                                                        \
    }                                                                                        \
    const int nblocks = (len + block_size - 1) / block_size;                                 \
    for (int b = 0; b < nblocks; b++) {                                                      \
        const long base = (long)table[b] * block_stride + (long)h * head_stride;             \
        const T *kb = k_cache + base, *vb = v_cache + base;                                  \
        const int rest = len - b * block_size;                                               \
        const int n = rest < block_size ? rest : block_size;                                 \
        /* scores: each K row (one dim, all tokens) is converted once for all G heads */     \
        for (int g = 0; g < G; g++) memset(sc[g], 0, sizeof(float) * block_size);            \
        for (int d = 0; d < head_dim; d++) {                                                 \
            const T *kr = kb + (long)d * block_size;                                         \
            _Pragma("omp simd")                                                              \
            for (int t = 0; t < block_size; t++) row[t] = LOAD(kr[t]);                       \
            for (int g = 0; g < G; g++) {                                                    \
                const float qd = qv[g][d];                                                   \
                float *sg = sc[g];                                                           \
                _Pragma("omp simd")                                                          \
                for (int t = 0; t < block_size; t++) sg[t] += qd * row[t];                   \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; g++) {                                                        \
            float bmax = -INFINITY;                                                          \
            for (int t = 0; t < n; t++) bmax = sc[g][t] > bmax ? sc[g][t] : bmax;            \
            const float new_m = bmax > m[g] ? bmax : m[g];                                   \
            const float corr = expf(m[g] - new_m);                                           \
            float psum = 0.f;                                                                \
            float *sg = sc[g];                                                               \
            _Pragma("omp simd reduction(+:psum)")                                            \
            for (int t = 0; t < n; t++) {                                                    \
                sg[t] = exp_nonpos(sg[t] - new_m);                                           \
                psum += sg[t];                                                               \
            }                                                                                \
            l[g] = l[g] * corr + psum;                                                       \
            m[g] = new_m;                                                                    \
            float *a = acc[g];                                                               \
            _Pragma("omp simd")                                                              \
            for (int d = 0; d < head_dim; d++) a[d] *= corr;                                 \
        }                                                                                    \
        /* values: each V row is converted once for all G heads */                          \
        for (int t = 0; t < n; t++) {                                                        \
            const T *vr = vb + (long)t * head_dim;                                           \
            _Pragma("omp simd")                                                              \
            for (int d = 0; d < head_dim; d++) row[d] = LOAD(vr[d]);                         \
            for (int g = 0; g < G; g++) {                                                    \
                const float p = sc[g][t];                                                    \
                float *a = acc[g];                                                           \
                _Pragma("omp simd")                                                          \
                for (int d = 0; d < head_dim; d++) a[d] += p * row[d];                       \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (int g = 0; g < G; g++) {                                                            \
        float *dst = out + ((long)s * num_q_heads + h * G + g) * head_dim;                   \
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;                                     \
        for (int d = 0; d < head_dim; d++) dst[d] = acc[g][d] * inv;                         \
    }                                                                                        \
}                                                                                            \
                                                                                             \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,     \
         int max_blocks, const int32_t *ctx_lens, int num_seqs, int num_q_heads,             \
         int num_kv_heads, int head_dim, int block_size, float scale, float *out,            \
         int num_threads) {                                                                  \
    const int G = num_q_heads / num_kv_heads;                                                \
    if (G > MAX_GROUP || head_dim > MAX_DIM || block_size > MAX_BLOCK) return -1;            \
    const long head_stride = (long)block_size * head_dim;                                    \
    const long block_stride = head_stride * num_kv_heads;                                    \
    _Pragma("omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)")       \
    for (int s = 0; s < num_seqs; s++)                                                       \
        for (int h = 0; h < num_kv_heads; h++)                                               \
            if (G == 3 && head_dim == 64 && block_size == 16) /* SmolLM2: constants unroll */ \
                NAME##_one(q, k_cache, v_cache, block_tables + (long)s * max_blocks,         \
                           ctx_lens[s], s, h, 3, num_q_heads, 64, 16,                        \
                           block_stride, head_stride, scale, out);                           \
            else                                                                             \
                NAME##_one(q, k_cache, v_cache, block_tables + (long)s * max_blocks,         \
                           ctx_lens[s], s, h, G, num_q_heads, head_dim, block_size,          \
                           block_stride, head_stride, scale, out);                           \
    return 0;                                                                                \
}

#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F32(x) (x)

DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, LOAD_BF16)
DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32)
