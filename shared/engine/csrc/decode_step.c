/* Every layer of a small decode step in one call: the same kernels, no Python between them.
 *
 * Why: at one to a few decode rows the kernels themselves stream weights near the memory
 * bandwidth, and what was left of a step was Python: nine calls per layer through ctypes,
 * a tensor allocation for each result, the attribute lookups, about 2-3 ms of a 20 ms step
 * on this model. Here a C loop runs the layers with the kernels of ops.c, gemv.c and
 * paged_attention.c in the order model.py's native path runs them, on scratch buffers
 * allocated once per call, so the arithmetic (rounding included) is exactly that path's.
 *
 * Only for steps where every row is a one-token decode and the rows fit the native
 * kernels (the caller checks): prefill chunks need SDPA, more rows need the library GEMMs.
 * With the native GEMMs (gemm_bf16.c, gemm_f32.c) that is any decode step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The kernels this driver calls (defined in the other sources of the library). */
void rms_norm(void *h, const void *delta, const void *weight, void *out, int rows, int dim,
              float eps, int bf16, int num_threads);
void silu_mul(const void *gate_up, void *out, int rows, int inter, int bf16, int num_threads);
void rope_kv_write(void *qkv, const float *cos, const float *sin, const int64_t *positions,
                   int rows, int num_q_heads, int num_kv_heads, int head_dim,
                   const int64_t *blocks, const int64_t *offsets, void *k_cache, void *v_cache,
                   int block_size, int bf16, int num_threads);
int gemv_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
              int M, int N, int K, int nt);
int gemm_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
              int M, int N, int K, int nt);
int gemv_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
             int nt);
int gemm_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
             int nt);
int gemv_i8(const void *x, int x_bf16, const int8_t *w, const float *sw, const float *bias,
            void *y, int M, int N, int K, int nt);
void head_rms_norm(void *qkv, long stride, int rows, int num_q_heads, int num_kv_heads,
                   int head_dim, const void *q_weight, const void *k_weight, float eps,
                   int bf16, int num_threads);
int paged_decode_attention_bf16(const void *q, long q_stride, int act_bf16, const void *k_cache,
                                const void *v_cache, const int32_t *block_tables, int max_blocks,
                                const int32_t *ctx_lens, int num_seqs, int num_q_heads,
                                int num_kv_heads, int head_dim, int block_size, float scale,
                                int window, void *out, int num_threads);
int paged_decode_attention_f32(const void *q, long q_stride, int act_bf16, const void *k_cache,
                               const void *v_cache, const int32_t *block_tables, int max_blocks,
                               const int32_t *ctx_lens, int num_seqs, int num_q_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, void *out, int num_threads);

/* One linear layer as the native kernels see it: packed weights, int8 scales (NULL:
 * dense), bias, and whether the weights are in the GEMM's panels (else the GEMV's).
 * An int8 layer may also carry its dequantized weights in the GEMM's panels (`dense`,
 * with their own bias): past `i8_rows` rows a step is bound by compute, not by reading
 * weights, and linear.py's Int8Linear multiplies those instead (the same values). */
typedef struct {
    const void *weight;
    const float *scales;
    const float *bias;
    int out_features, in_features;
    int gemm;
    const void *dense;
    const float *dense_bias;
    int i8_rows;
} Linear;

typedef struct {
    const void *input_norm, *post_norm;  /* activation dtype, [hidden] */
    const void *q_norm, *k_norm;  /* [head_dim] per-head norms before RoPE (Qwen3), or NULL */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;  /* this layer's pool: [blocks, kv_heads, dim, bs] / [.., bs, dim] */
    int window;  /* sliding-window attention's span in tokens (0: the whole context) */
} Layer;

typedef struct {
    int num_layers, hidden, inter, num_q_heads, num_kv_heads, head_dim, block_size;
    int act_bf16, kv_bf16;
    float eps, scale;
    const float *cos, *sin;  /* rope tables [positions, head_dim] */
    const Layer *layers;
} Model;

static size_t act_size(const Model *m) { return m->act_bf16 ? 2 : 4; }

/* The GEMM of the activations' dtype, on weights in its panels. */
static int gemm(const Model *m, const void *panels, const float *bias, const void *x, void *y,
                int rows, const Linear *lin, int nt) {
    if (m->act_bf16)
        return gemm_bf16((const uint16_t *)x, (const uint16_t *)panels, bias, (uint16_t *)y,
                         rows, lin->out_features, lin->in_features, nt);
    return gemm_f32((const float *)x, (const float *)panels, bias, (float *)y, rows,
                    lin->out_features, lin->in_features, nt);
}

/* y = x W^T for `rows` rows (int8 weights: the ones with scales). */
static int linear(const Model *m, const Linear *lin, const void *x, void *y, int rows, int nt) {
    if (lin->scales && lin->dense && rows > lin->i8_rows)
        return gemm(m, lin->dense, lin->dense_bias, x, y, rows, lin, nt);
    if (lin->scales)
        return gemv_i8(x, m->act_bf16, (const int8_t *)lin->weight, lin->scales, lin->bias, y,
                       rows, lin->out_features, lin->in_features, nt);
    if (lin->gemm) return gemm(m, lin->weight, lin->bias, x, y, rows, lin, nt);
    if (m->act_bf16)
        return gemv_bf16((const uint16_t *)x, (const uint16_t *)lin->weight, lin->bias,
                         (uint16_t *)y, rows, lin->out_features, lin->in_features, nt);
    return gemv_f32((const float *)x, (const float *)lin->weight, lin->bias, (float *)y, rows,
                    lin->out_features, lin->in_features, nt);
}

/* h [rows, hidden] in, updated in place through every layer's attention residual; on
 * return `delta` [rows, hidden] holds the last layer's MLP output, still to be added to h
 * (the final norm fuses that add, as the next layer's input norm would). 0 on success. */
int decode_layers(const Model *m, void *h, void *delta, int rows, const int64_t *positions,
                  const int64_t *slot_blocks, const int64_t *slot_offsets,
                  const int32_t *block_tables, int max_blocks, const int32_t *ctx_lens,
                  int num_threads) {
    const int width = (m->num_q_heads + 2 * m->num_kv_heads) * m->head_dim;
    const int attn_width = m->num_q_heads * m->head_dim;
    const size_t es = act_size(m);
    char *scratch = (char *)malloc(es * (size_t)rows * (m->hidden + width + attn_width +
                                                        2 * m->inter + m->inter));
    if (!scratch) return -2;
    void *x = scratch;
    void *qkv = scratch + es * rows * m->hidden;
    void *attn = (char *)qkv + es * rows * width;
    void *gate_up = (char *)attn + es * rows * attn_width;
    void *act = (char *)gate_up + es * rows * 2 * m->inter;
    int rc = 0;
    for (int i = 0; i < m->num_layers && rc == 0; i++) {
        const Layer *L = &m->layers[i];
        rms_norm(h, i ? delta : NULL, L->input_norm, x, rows, m->hidden, m->eps, m->act_bf16,
                 num_threads);
        rc |= linear(m, &L->qkv, x, qkv, rows, num_threads);
        if (L->q_norm)
            head_rms_norm(qkv, width, rows, m->num_q_heads, m->num_kv_heads, m->head_dim,
                          L->q_norm, L->k_norm, m->eps, m->act_bf16, num_threads);
        rope_kv_write(qkv, m->cos, m->sin, positions, rows, m->num_q_heads, m->num_kv_heads,
                      m->head_dim, slot_blocks, slot_offsets, L->k_cache, L->v_cache,
                      m->block_size, m->act_bf16, num_threads);
        rc |= (m->kv_bf16 ? paged_decode_attention_bf16 : paged_decode_attention_f32)(
            qkv, width, m->act_bf16, L->k_cache, L->v_cache, block_tables, max_blocks,
            ctx_lens, rows, m->num_q_heads, m->num_kv_heads, m->head_dim, m->block_size,
            m->scale, L->window, attn, num_threads);
        rc |= linear(m, &L->o, attn, delta, rows, num_threads);
        rms_norm(h, delta, L->post_norm, x, rows, m->hidden, m->eps, m->act_bf16, num_threads);
        rc |= linear(m, &L->gate_up, x, gate_up, rows, num_threads);
        silu_mul(gate_up, act, rows, m->inter, m->act_bf16, num_threads);
        rc |= linear(m, &L->down, act, delta, rows, num_threads);
    }
    free(scratch);
    return rc;
}
