// The AVX512-BF16 tile of linear_bf16.c (the int8 grid past 8 rows) and linear_kq_gemm.c (the
// K-quants past 8 rows): up to four bf16 x rows against four bf16 weight rows, their 16 sums
// reduced together (sum16). Include only where the build has AVX512-BF16 and AVX512-BW.

#ifndef LOOM_BF16_TILE_H
#define LOOM_BF16_TILE_H

#include <immintrin.h>
#include <stdint.h>

#define PIN(v) __asm__("" : "+v"(v))

// 16 vectors -> one: lane i the sum of v[i]'s 16 lanes, added in a fixed tree (pairs within
// 128-bit lanes, then across them): 45 instructions, not 16 reductions of 8 each (at K = 576 a
// sum is 18 products, so those were ~30% of a tile).
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16])
{
    __m512 p[8], q[4];
    for (int i = 0; i < 8; i++)  // lane L of p[i]: v[2i]'s at 0 and 2, v[2i + 1]'s at 1 and 3
        p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // lane L of q[i]: v[4i .. 4i + 3]'s sums over lane L
        q[i] = _mm512_add_ps(
            (__m512)_mm512_unpacklo_pd((__m512d)p[2 * i], (__m512d)p[2 * i + 1]),
            (__m512)_mm512_unpackhi_pd((__m512d)p[2 * i], (__m512d)p[2 * i + 1]));
    // across the four 128-bit lanes: (0 + 1, 2 + 3), then their sum
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x88),
                                     _mm512_shuffle_f32x4(q[0], q[1], 0xDD));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x88),
                                     _mm512_shuffle_f32x4(q[2], q[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88),
                         _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// R (1..4) bf16 x rows (ldx apart) against four bf16 weight rows of K (K apart): out[4 m + n]
// = x row m . weight row n (rows past R: zeros). A row's sums do not depend on the tile's other
// rows.
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, int64_t ldx,
                                                            const int R, const uint16_t *w,
                                                            int64_t K, float out[16])
{
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) {
            wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
            PIN(wv[j]);
        }
        for (int r = 0; r < R; r++) {
            __m512bh u = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
            PIN(u);
            for (int j = 0; j < 4; j++) a[4 * r + j] = _mm512_dpbf16_ps(a[4 * r + j], wv[j], u);
        }
    }
    _mm512_storeu_ps(out, sum16(a));
}

#endif
