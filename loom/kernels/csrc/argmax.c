// Greedy argmax over fp32 rows (the sampler's), built without fast math (loom/kernels/build.py):
// its compares must see NaN.

#include <stdint.h>
#include "loom.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
// The lanes' greatest values and where each came first -> the row's so far (the first of
// ties); -1 where the first i values hold a NaN, whose index `best` then is.
static int lanes_best(const float *x, int64_t i, int nan, const float *tops, const int32_t *ats,
                      int lanes, float *top, int64_t *best)
{
    if (nan) {  // the first NaN (in what the lanes read), as torch
        for (int64_t k = 0; k < i; k++)
            if (x[k] != x[k]) {
                *best = k;
                return -1;
            }
    }
    *top = tops[0];
    *best = ats[0];
    for (int k = 1; k < lanes; k++)
        if (tops[k] > *top || (tops[k] == *top && ats[k] < *best)) {
            *top = tops[k];
            *best = ats[k];
        }
    return 0;
}
#endif

// out[r] = the index of the greatest of row r's n values (rows ld floats apart), the first of
// ties, and the first NaN's where a row has one: torch's max(dim=-1).indices (the sampler's
// greedy pick). IEEE compares; 16 lanes with AVX-512, 8 with AVX2, each its greatest and where
// it came first.
static int64_t argmax_row(const float *x, int64_t n)
{
    int64_t i = 0, best = 0;
    float top = x[0];
#ifdef __AVX512F__
    if (n >= 16 && n <= INT32_MAX) {
        __m512 lane_top = _mm512_loadu_ps(x);
        const __m512i step = _mm512_set1_epi32(16);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i lane_at = at;
        __mmask16 nan = _mm512_cmp_ps_mask(lane_top, lane_top, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            at = _mm512_add_epi32(at, step);
            const __mmask16 up = _mm512_cmp_ps_mask(v, lane_top, _CMP_GT_OQ);
            lane_top = _mm512_mask_mov_ps(lane_top, up, v);
            lane_at = _mm512_mask_mov_epi32(lane_at, up, at);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        float tops[16];
        int32_t ats[16];
        _mm512_storeu_ps(tops, lane_top);
        _mm512_storeu_si512(ats, lane_at);
        if (lanes_best(x, i, nan, tops, ats, 16, &top, &best)) return best;
    }
#elif defined(__AVX2__)
    if (n >= 8 && n <= INT32_MAX) {
        __m256 lane_top = _mm256_loadu_ps(x);
        const __m256i step = _mm256_set1_epi32(8);
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256 lane_at = _mm256_castsi256_ps(at);  // int32 lanes, blended as floats
        int nan = _mm256_movemask_ps(_mm256_cmp_ps(lane_top, lane_top, _CMP_UNORD_Q));
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            at = _mm256_add_epi32(at, step);
            const __m256 up = _mm256_cmp_ps(v, lane_top, _CMP_GT_OQ);
            lane_top = _mm256_blendv_ps(lane_top, v, up);
            lane_at = _mm256_blendv_ps(lane_at, _mm256_castsi256_ps(at), up);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float tops[8];
        int32_t ats[8];
        _mm256_storeu_ps(tops, lane_top);
        _mm256_storeu_si256((__m256i *)ats, _mm256_castps_si256(lane_at));
        if (lanes_best(x, i, nan, tops, ats, 8, &top, &best)) return best;
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > top) {
            top = x[i];
            best = i;
        }
    }
    return best;
}

void loom_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out,
                      int num_threads)
{
    // A team only for a million values or more (32 rows of a 49k vocabulary: ~0.2 ms alone,
    // half that on two cores): below, one thread takes under ~0.1 ms, and waking a team for it
    // saved ~20 us on a quiet 2-core machine but cost a scheduler slice (~12 ms at the 95th
    // percentile) whenever a core was busy elsewhere, as in a speculative step's 8 rows.
#pragma omp parallel for num_threads(num_threads) if (rows >= 2 && rows * n >= (1 << 20))
    for (int64_t r = 0; r < rows; r++) out[r] = n > 0 ? argmax_row(x + r * ld, n) : 0;
}
