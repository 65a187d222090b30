// Elementwise ops some architectures' layers add to Llama's (layer_ops.c), for the CPU in fp32:
// RMSNorm over each attention head of q and k (Qwen3, Gemma 3) and GELU-tanh(gate) * up
// (Gemma). The per-module path and the decoder stack (decoder_q8.c) call the same functions,
// so both give the same bits. Parallel over tokens when there are enough of them.

#include <math.h>
#include <stdint.h>

#include "loom.h"

#define PAR_MIN_TOKENS 16

// row = rms_norm(row) * weight over d values (layer_ops.c's arithmetic, residual NULL).
static inline void norm_row(float *row, const float *weight, int64_t d, float eps)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += row[i] * row[i];
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; i++) row[i] = weight[i] * (row[i] * inv);
}

void loom_qk_norm_f32(float *qkv, int64_t stride, int64_t n, int64_t num_heads, int64_t kv_heads,
                      int64_t D, const float *q_weight, const float *k_weight, float eps,
                      int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n >= PAR_MIN_TOKENS)
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < num_heads + kv_heads; h++)
            norm_row(qkv + t * stride + h * D, h < num_heads ? q_weight : k_weight, D, eps);
}

// torch's gelu(g, approximate="tanh") = g / 2 * (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
// tanh(u) as (e^2u - 1) / (e^2u + 1) with u kept to +-10 (tanh is 1 to fp32 there; e^2u
// stays finite), so the loop vectorizes (expf from libmvec).
void loom_gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t n, int64_t d,
                            int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n >= PAR_MIN_TOKENS)
    for (int64_t t = 0; t < n; t++) {
        const float *g = gate_up + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; i++) {
            const float x = g[i];
            const float a = fminf(fmaxf(0.7978845608028654f * (x + 0.044715f * x * x * x), -10.0f),
                                  10.0f);
            const float e = expf(2.0f * a);
            o[i] = 0.5f * x * (1.0f + (e - 1.0f) / (e + 1.0f)) * u[i];
        }
    }
}
