// A whole Llama-family decoder stack in one call, for int8 weights on the CPU in fp32: the
// same kernels, in the same order, as the per-module torch path (loom/models/llama.py), so the
// bits are the same; what goes is Python's dispatch between ~10 kernels in each of ~30 layers
// (at one stream, most of a step's time outside the matmuls).

#include <stdint.h>
#include <string.h>

typedef struct {
    const float *in_norm, *post_norm;
    const uint8_t *qkv_w; const float *qkv_s, *qkv_m, *qkv_b;  // qkv_b: NULL without bias
    const uint8_t *o_w; const float *o_s, *o_m;
    const uint8_t *gu_w; const float *gu_s, *gu_m;
    const uint8_t *d_w; const float *d_s, *d_m;
    void *k_cache, *v_cache;
    int64_t window;  // sliding window, 0 for none
    int64_t qkv_bits, o_bits, gu_bits, d_bits;  // bits per stored weight: 8 or 4
} LoomLayerQ8;

int loom_linear_q8_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads);
void loom_add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t n, int64_t d,
                           float eps, int num_threads);
void loom_silu_mul_f32(const float *gate_up, float *out, int64_t n, int64_t d, int num_threads);
void loom_rope_write_kv_f32(float *qkv, int64_t stride, int64_t n, int64_t num_heads,
                            int64_t kv_heads, int64_t D, const float *table,
                            const int64_t *positions, const int64_t *slots, void *k_cache,
                            void *v_cache, int num_threads, int kv_type);
int loom_paged_attention_f32(const float *q, int64_t q_tok_stride, const void *k_cache,
                             const void *v_cache, const int64_t *block_tables, int64_t max_blocks,
                             const int64_t *positions, const int64_t *tiles, int64_t num_tiles,
                             int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t window, float scale, int num_threads,
                             int kv_type, float *out);

// hidden [M, H]: the embeddings in, the residual stream after. Returns the final-normed hidden
// states in buf_h [M, H]. Scratch: buf_qkv [M, (heads + 2 kv_heads) D], buf_attn [M, heads D],
// buf_gu [M, 2 I], buf_act [M, I]. kv_type: what the caches hold (0 fp32, 1 fp16, 2 int8).
// Returns 0, or the first kernel's error.
int loom_llama_forward_q8(
    const LoomLayerQ8 *layers, int64_t num_layers, const float *final_norm, int64_t H, int64_t I,
    int64_t num_heads, int64_t kv_heads, int64_t D, int64_t block_size, float eps, float scale,
    const float *rope_table, int64_t M, float *hidden, const int64_t *positions,
    const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles,
    int64_t num_tiles, float *buf_h, float *buf_qkv, float *buf_attn, float *buf_gu,
    float *buf_act, int nt, int kv_type)
{
    const int64_t qkv_n = (num_heads + 2 * kv_heads) * D, q_n = num_heads * D;
    int rc;
    memcpy(buf_h, hidden, (size_t)(M * H) * sizeof(float));
    loom_add_rms_norm_f32(buf_h, NULL, layers[0].in_norm, M, H, eps, nt);
    for (int64_t l = 0; l < num_layers; l++) {
        const LoomLayerQ8 *L = &layers[l];
        if (l > 0)  // hidden += the last MLP's output; buf_h = norm(hidden)
            loom_add_rms_norm_f32(buf_h, hidden, L->in_norm, M, H, eps, nt);
        if ((rc = loom_linear_q8_f32(buf_h, M, H, H, L->qkv_w, L->qkv_s, L->qkv_m, L->qkv_b,
                                     qkv_n, buf_qkv, qkv_n, (int)L->qkv_bits, nt)))
            return rc;
        loom_rope_write_kv_f32(buf_qkv, qkv_n, M, num_heads, kv_heads, D, rope_table, positions,
                               slots, L->k_cache, L->v_cache, nt, kv_type);
        if ((rc = loom_paged_attention_f32(buf_qkv, qkv_n, L->k_cache, L->v_cache, block_tables,
                                           max_blocks, positions, tiles, num_tiles, num_heads,
                                           kv_heads, D, block_size, L->window, scale, nt,
                                           kv_type, buf_attn)))
            return rc;
        if ((rc = loom_linear_q8_f32(buf_attn, M, q_n, q_n, L->o_w, L->o_s, L->o_m, NULL, H,
                                     buf_h, H, (int)L->o_bits, nt)))
            return rc;
        loom_add_rms_norm_f32(buf_h, hidden, L->post_norm, M, H, eps, nt);
        if ((rc = loom_linear_q8_f32(buf_h, M, H, H, L->gu_w, L->gu_s, L->gu_m, NULL, 2 * I,
                                     buf_gu, 2 * I, (int)L->gu_bits, nt)))
            return rc;
        loom_silu_mul_f32(buf_gu, buf_act, M, I, nt);
        if ((rc = loom_linear_q8_f32(buf_act, M, I, I, L->d_w, L->d_s, L->d_m, NULL, H, buf_h,
                                     H, (int)L->d_bits, nt)))
            return rc;
    }
    loom_add_rms_norm_f32(buf_h, hidden, final_norm, M, H, eps, nt);
    return 0;
}
