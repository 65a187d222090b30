// One group of 32 weights of an int8-grid row (loom.h's `bits`: 8, 4, 4 | LOOM_Q8_LEVELS,
// LOOM_Q8_Q5) as fp32 q * s + m, for the AVX-512 fp32 paths of linear_q8.c and the bf16
// conversion of linear_bf16.c: the same floats in both, so the bf16 kernel rounds exactly the
// weights the fp32 kernel multiplies. And loom_q5_bytes, the fifth bits as byte values, for the
// byte-wise unpackers (linear_q8.c's AVX2 path, linear_amx.c, linear_kq_gemm.c).

#ifndef LOOM_GRID_GROUP_H
#define LOOM_GRID_GROUP_H

#include <immintrin.h>
#include <stdint.h>
#include "loom.h"

#ifdef __SSSE3__
// 16 bytes: byte i is 16 where bit i of h is set, else 0 (a 5-bit group's fifth bits, 16 of
// them, as what they add to the nibbles' values).
static inline __attribute__((always_inline)) __m128i loom_q5_bytes(uint32_t h)
{
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm_maskz_mov_epi8((__mmask16)h, _mm_set1_epi8(16));
#else
    const __m128i sel = _mm_set1_epi64x((long long)0x8040201008040201ull);  // bit i % 8
    const __m128i t = _mm_and_si128(
        _mm_unpacklo_epi64(_mm_set1_epi8((char)h), _mm_set1_epi8((char)(h >> 8))), sel);
    return _mm_and_si128(_mm_cmpeq_epi8(t, sel), _mm_set1_epi8(16));
#endif
}
#endif

#ifdef __AVX512F__
// Group g of row q (K weights, `bits` a weight) as lo (values 0..15) and hi (16..31), each
// q * s + m in one fma. 4-bit forms: the group's 16 possible weights computed once, each nibble
// picking its lane (vpermps reads an index's low 4 bits: the low nibble as it is, the high one
// shifted down), in 5 instructions instead of 8 (~20% faster for one row through a layer larger
// than L2: one stream's decode is bound by instructions there); 5-bit: two tables, values 0..15
// and 16..31, each weight's fifth bit picking its table (vpermt2ps reads an index's bit 4 so).
static inline __attribute__((always_inline)) void loom_grid_group(const uint8_t *q, int bits,
                                                                  int64_t K, int64_t g, float s,
                                                                  float m, __m512 *lo, __m512 *hi)
{
    const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
    if (bits == 8) {
        const uint8_t *p = q + g * 32;
        *lo = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))), vs,
            vm);
        *hi = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))),
            vs, vm);
        return;
    }
    const __m512 iota = bits & LOOM_Q8_LEVELS  // the nibbles' values
        ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)loom_iq4_q)))
        : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(iota, vs, vm);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 16)));
    if (bits == LOOM_Q8_Q5) {
        const uint32_t h = loom_q5_high(q, K, g);
        const __m512 high = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), vs, vm);
        const __m512i nib = _mm512_set1_epi32(0x0F), k16 = _mm512_set1_epi32(16);
        const __m512i l = _mm512_and_si512(b, nib), u = _mm512_srli_epi32(b, 4);
        *lo = _mm512_permutex2var_ps(table, _mm512_mask_or_epi32(l, (__mmask16)h, l, k16), high);
        *hi = _mm512_permutex2var_ps(table, _mm512_mask_or_epi32(u, (__mmask16)(h >> 16), u, k16),
                                     high);
        return;
    }
    *lo = _mm512_permutexvar_ps(b, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
#endif

#endif
