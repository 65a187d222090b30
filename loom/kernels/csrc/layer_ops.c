// Fused elementwise ops of a decoder layer, for the CPU in fp32. Each replaces several torch
// ops (each 5-40 us of dispatch on a small CPU at one token; rms_norm alone measured ~27 us for
// 576 floats) with one call. Parallel over tokens when there are enough of them.

#include <stdint.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <string.h>

#include "half.h"
#include "loom.h"

#define PAR_MIN_TOKENS 16

// residual += x (when residual is not NULL), then x = rms_norm(residual or x) * weight,
// in place. x, residual: [n, d], contiguous.
void loom_add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t n, int64_t d,
                           float eps, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n >= PAR_MIN_TOKENS)
    for (int64_t t = 0; t < n; t++) {
        float *xr = x + t * d;
        float *src = xr;
        if (residual) {
            float *rr = residual + t * d;
            for (int64_t i = 0; i < d; i++) rr[i] += xr[i];
            src = rr;
        }
        if (!weight) {  // no norm (a layer without one: OLMo 2's): the add alone
            if (src != xr) memcpy(xr, src, (size_t)d * sizeof(float));
            continue;
        }
        float ss = 0.0f;
        for (int64_t i = 0; i < d; i++) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) xr[i] = weight[i] * (src[i] * inv);
    }
}

#ifdef __AVX512F__
// silu(g) * u for 16 floats: g / (1 + e^-g), e^-g = 2^n e^r with n = round(-g / ln 2) and r =
// -g - n ln 2 (ln 2 in two parts, so r keeps its low bits; |r| <= ln 2 / 2), e^r by its Taylor
// series to r^7 (relative error under 1e-8), and the division as a reciprocal estimate and one
// Newton step (relative error ~2^-28). -g is kept to <= 87 (e^87 ~ 6e37: 1 + e^-g and its
// reciprocal stay normal floats; silu(g) of g <= -87 is then ~g 1.6e-38 instead of ~g e^g, 0
// to fp32's eye next to any other term, where expf and a division gave NaN past g ~ -88).
// glibc's vector expf and a division took ~1.4x as long.
static inline __m512 silu_mul16(__m512 g, __m512 u)
{
    const __m512 x = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2's first 10 bits
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);     // and the rest
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 d = _mm512_add_ps(_mm512_scalef_ps(p, n), _mm512_set1_ps(1.0f));
    __m512 q = _mm512_rcp14_ps(d);
    q = _mm512_mul_ps(q, _mm512_fnmadd_ps(d, q, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(_mm512_mul_ps(g, u), q);
}
#elif defined(__AVX2__) && defined(__FMA__)
// silu_mul16's steps for 8 floats in AVX2: 2^n built in the exponent bits (-g also kept to >= -87,
// so n stays within a normal float's exponents), and an IEEE division.
static inline __m256 silu_mul8(__m256 g, __m256 u)
{
    const __m256 x = _mm256_max_ps(
        _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(87.0f)),
        _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    const __m256 d = _mm256_add_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(1.0f));
    return _mm256_div_ps(_mm256_mul_ps(g, u), d);
}
#endif

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, d + i]; gate_up [n, 2d], out [n, d]. Without
// AVX-512 or AVX2 (and past a row's last 16 or 8), expf and a division, -g kept to <= 87 as
// silu_mul16 does.
void loom_silu_mul_f32(const float *gate_up, float *out, int64_t n, int64_t d, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n >= PAR_MIN_TOKENS)
    for (int64_t t = 0; t < n; t++) {
        const float *g = gate_up + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= d; i += 16)
            _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
        if (i < d) {
            const __mmask16 k = (__mmask16)((1u << (d - i)) - 1);
            _mm512_mask_storeu_ps(o + i, k, silu_mul16(_mm512_maskz_loadu_ps(k, g + i),
                                                       _mm512_maskz_loadu_ps(k, u + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= d; i += 8)
            _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
        for (; i < d; i++) o[i] = g[i] / (1.0f + expf(fminf(-g[i], 87.0f))) * u[i];
    }
}

// x[t, i] *= sigmoid(g[t, i]) = 1 / (1 + exp(-g)); x, g [n, d] (Qwen3.5's gated attention
// output, in the module path and the stack alike).
void loom_sigmoid_mul_f32(float *x, const float *g, int64_t n, int64_t d, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n >= PAR_MIN_TOKENS)
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++)
            x[t * d + i] *= 1.0f / (1.0f + expf(-g[t * d + i]));
}

// n fp32 values -> fp16, rounded to nearest even (as torch's .half()).
static inline void f32_to_f16(const float *src, int64_t n, uint16_t *dst)
{
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = loom_f32_to_f16(src[i]);
}


// One cache row of an int8 cache (--kv-cache-dtype int8) from kv_heads * D fp32 values: per
// head, D uint8 values, then D / 32 fp32 scales, then D / 32 fp32 minimums: the weights' grid,
// group by group (the same bytes as loom.attention.backends.torch_ref.quantize_kv). A head's row
// is D + D / 4 bytes, a multiple of 8 bytes (D is a multiple of 32), so its floats are aligned.
static void f32_to_kv_i8(const float *src, int64_t kv_heads, int64_t D, uint8_t *dst)
{
    for (int64_t h = 0; h < kv_heads; h++) {
        uint8_t *q = dst + h * (D + D / 4);
        float *scales = (float *)(q + D), *mins = scales + D / 32;
        for (int64_t g = 0; g < D / 32; g++)
            loom_quantize_q8_group(src + h * D + g * 32, q + g * 32, scales + g, mins + g);
    }
}

// Rotary embedding of the q and k heads of packed qkv rows, in place, then the rotated k and
// the v heads written to their cache slots. qkv: [n] rows `stride` floats apart, each
// [num_heads q | kv_heads k | kv_heads v] x D. table: row p = [cos | cos | -sin | sin], each
// D/2 wide (loom/layers/rotary.py). Cache: [num_slots, kv_heads, D] for K and for V, fp32
// (kv_type 0), fp16 (1, rounded to nearest), or int8 (2: [num_slots, kv_heads, D + D / 4]
// bytes, see f32_to_kv_i8).
void loom_rope_write_kv_f32(float *qkv, int64_t stride, int64_t n, int64_t num_heads,
                            int64_t kv_heads, int64_t D, const float *table,
                            const int64_t *positions, const int64_t *slots, void *k_cache,
                            void *v_cache, int num_threads, int kv_type)
{
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) if (n >= PAR_MIN_TOKENS)
    for (int64_t t = 0; t < n; t++) {
        float *row = qkv + t * stride;
        const float *cs = table + positions[t] * 2 * D, *sn = cs + D;
        for (int64_t h = 0; h < num_heads + kv_heads; h++) {
            float *x = row + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * cs[i] + x2 * sn[i];
                x[i + half] = x2 * cs[i + half] + x1 * sn[i + half];
            }
        }
        const float *k = row + num_heads * D, *v = k + kv_heads * D;
        const int64_t at = slots[t] * kv_heads * D;
        if (kv_type == 2) {
            f32_to_kv_i8(k, kv_heads, D, (uint8_t *)k_cache + slots[t] * kv_heads * (D + D / 4));
            f32_to_kv_i8(v, kv_heads, D, (uint8_t *)v_cache + slots[t] * kv_heads * (D + D / 4));
        } else if (kv_type == 1) {
            f32_to_f16(k, kv_heads * D, (uint16_t *)k_cache + at);
            f32_to_f16(v, kv_heads * D, (uint16_t *)v_cache + at);
        } else {
            float *kc = (float *)k_cache + at, *vc = (float *)v_cache + at;
            for (int64_t i = 0; i < kv_heads * D; i++) { kc[i] = k[i]; vc[i] = v[i]; }
        }
    }
}
