// GGUF's K-quant super-blocks' scales, shared by linear_kquant.c (the bit layouts are in its
// header comment) and linear_kq_gemm.c: one decoding of the 6-bit scales and of Q6_K's int8 ones.

#ifndef LOOM_KQUANT_BLOCKS_H
#define LOOM_KQUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>
#include "half.h"
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 256  // weights a super-block
enum { Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's type ids

// Formats whose scales (and offsets) come a run of 16 weights (Q2_K, Q3_K, Q6_K), not a
// sub-block of 32 (Q4_K, Q5_K): x's terms of the offsets are a run's sums.
static inline int runs16(int fmt) { return fmt == Q6_K || fmt == Q3_K || fmt == Q2_K; }

// Q3_K's 12 bytes of scales (at 96) -> its 16 runs' 6-bit scales s + 32 (0..63) as bytes: run
// h's low 4 bits in byte h (h < 8: low nibble) or h - 8 (high nibble), its top 2 at bits
// 2 (h / 4) of byte 8 + h % 4 (ggml's word arithmetic).
static inline void q3_scale_bytes(const uint8_t *blk, uint8_t out[16])
{
    uint32_t a[4];
    memcpy(a, blk + 96, 12);
    const uint32_t t = a[2];
    a[2] = ((a[0] >> 4) & 0x0f0f0f0fu) | (((t >> 4) & 0x03030303u) << 4);
    a[3] = ((a[1] >> 4) & 0x0f0f0f0fu) | (((t >> 6) & 0x03030303u) << 4);
    a[0] = (a[0] & 0x0f0f0f0fu) | ((t & 0x03030303u) << 4);
    a[1] = (a[1] & 0x0f0f0f0fu) | (((t >> 2) & 0x03030303u) << 4);
    memcpy(out, a, 16);
}

// The fp16 at p (little-endian), as fp32: F16C's conversion where the build has it.
static inline float f16_at(const uint8_t *p)
{
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return loom_f16_to_f32(h);
#endif
}

// Q4_K's and Q5_K's 12 bytes -> sc[0..7] then m[0..7], 6 bits each: bytes 0..3 hold sc 0..3
// (low 6 bits) and the top 2 bits of sc 4..7; bytes 4..7 the same for the minimums; bytes 8..11
// the low 4 bits of sc 4..7 (low nibbles) and of m 4..7 (high nibbles).
static inline void k4_words(const uint8_t *s, uint64_t *sc, uint64_t *mn)
{
    uint64_t q;  // sc 0..3, m 0..3 and their top bits' neighbours
    uint32_t w;  // low nibbles of sc 4..7, high nibbles of m 4..7
    memcpy(&q, s, 8);
    memcpy(&w, s + 8, 4);
    const uint64_t top = (q >> 2) & 0x3030303030303030u;  // bits 6-7 of bytes 0..7, at 4-5
    *sc = (q & 0x3f3f3f3fu) | (uint64_t)((w & 0x0f0f0f0fu) | (uint32_t)top) << 32;
    *mn = ((q >> 32) & 0x3f3f3f3fu) | (uint64_t)(((w >> 4) & 0x0f0f0f0fu) | (top >> 32)) << 32;
}

static inline void k4_scales(const uint8_t *s, uint8_t out[16])
{
    uint64_t sc, mn;
    k4_words(s, &sc, &mn);
    memcpy(out, &sc, 8);
    memcpy(out + 8, &mn, 8);
}

// A super-block's weight scale sw[h] and offset ow[h] for each run h of 16 (portable): the
// weight is sw[h] * q - ow[h], q its unsigned integer.
static inline void block_scales(const uint8_t *blk, int fmt, float sw[16], float ow[16])
{
    if (fmt == Q6_K) {
        const float d = f16_at(blk + 208);
        for (int h = 0; h < 16; h++) {
            sw[h] = d * (float)(int8_t)blk[192 + h];
            ow[h] = 32.0f * sw[h];
        }
        return;
    }
    if (fmt == Q3_K) {  // w = d (s - 32) (q - 4), q = 3 bits
        const float d = f16_at(blk + 108);
        uint8_t sc[16];
        q3_scale_bytes(blk, sc);
        for (int h = 0; h < 16; h++) {
            sw[h] = d * (float)((int)sc[h] - 32);
            ow[h] = 4.0f * sw[h];
        }
        return;
    }
    if (fmt == Q2_K) {  // byte h: the run's scale (low nibble) and minimum (high)
        const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
        for (int h = 0; h < 16; h++) {
            sw[h] = d * (float)(blk[h] & 15);
            ow[h] = dmin * (float)(blk[h] >> 4);
        }
        return;
    }
    const float d = f16_at(blk);
    const float dmin = f16_at(blk + 2);
    uint8_t sm[16];
    k4_scales(blk + 4, sm);
    for (int h = 0; h < 16; h++) {
        sw[h] = d * (float)sm[h / 2];
        ow[h] = dmin * (float)sm[8 + h / 2];
    }
}

#ifdef __AVX2__
// The largest of v's 8 lanes.
static inline float hmax8(__m256 v)
{
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

// Q3_K's 16 scales s - 32 (int8) from its 12 bytes at 96, as q3_scale_bytes but in registers
// (its bytes through memory into a vector stalled the AVX2 decode kernel): the low nibbles
// bytes 0..7 then their high nibbles, or'ed with bytes 8..11 shifted by 0, 2, 4, 6 a dword.
// Reads the 12 bytes only.
static inline __m128i q3_scales128(const uint8_t *blk)
{
    const __m128i v = _mm_loadl_epi64((const __m128i *)(blk + 96));
    uint32_t w;
    memcpy(&w, blk + 104, 4);
    const __m128i f = _mm_set1_epi8(15);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, f),
                                          _mm_and_si128(_mm_srli_epi16(v, 4), f));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)w),
                                                    _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

// The sum of v's 8 int32 lanes.
static inline int32_t hsum8_epi32(__m256i v)
{
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
    return _mm_cvtsi128_si32(u);
}
#endif

#endif
