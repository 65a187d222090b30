// Horizontal sums of many vectors at once (linear_vnni.c's output sums, paged_attention.c's
// scores): a tree that adds pairs of vectors' halves level by level, instead of a reduction a
// vector.
#ifndef LOOM_LANE_SUMS_H
#define LOOM_LANE_SUMS_H

#include <immintrin.h>

#ifdef __AVX512F__
// The sums of the n <= 16 vectors v into out[i], each in _mm512_reduce_add_ps's order (lanes
// i + 8, then i + 4, i + 2, i + 1), all in one tree: each level adds pairs of vectors' halves
// at once. After the four levels vector i's sum is lane 4 (i % 4) + i / 4.
static inline __attribute__((always_inline)) void sum_lanes(__m512 *v, const int n, float *out)
{
    const __m512 z = _mm512_setzero_ps();
    int k = n;
    for (int i = 0; i < (k + 1) / 2; i++) {  // lane i + lane i + 8 (0..7) of two vectors
        const __m512 a = v[2 * i], b = 2 * i + 1 < k ? v[2 * i + 1] : z;
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    k = (k + 1) / 2;
    for (int i = 0; i < (k + 1) / 2; i++) {  // + lane i + 4 (0..3): a block a vector
        const __m512 a = v[2 * i], b = 2 * i + 1 < k ? v[2 * i + 1] : z;
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    }
    k = (k + 1) / 2;
    for (int i = 0; i < (k + 1) / 2; i++) {  // + lane i + 2 (0..1)
        const __m512 a = v[2 * i], b = 2 * i + 1 < k ? v[2 * i + 1] : z;
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    }
    k = (k + 1) / 2;
    const __m512 a = v[0], b = k > 1 ? v[1] : z;  // + lane i + 1
    float all[16];
    _mm512_storeu_ps(all, _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88),
                                        _mm512_shuffle_ps(a, b, 0xDD)));
    for (int i = 0; i < n; i++) out[i] = all[4 * (i % 4) + i / 4];
}
#endif  // __AVX512F__

#if defined(__AVX2__) && !defined(__AVX512F__)
// The sums of the 8 vectors v into out[i] (lanes i of three levels: pairs, quads, halves).
static inline __attribute__((always_inline)) void sum_lanes8(const __m256 *v, float *out)
{
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 e = _mm256_hadd_ps(a, b), f = _mm256_hadd_ps(c, d);  // 0..3 | 4..7 halves
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(e, f, 0x20),
                                        _mm256_permute2f128_ps(e, f, 0x31)));
}
#endif

#endif  // LOOM_LANE_SUMS_H
