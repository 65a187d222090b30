// The int8 linear of linear_q8.c for many rows (prefill, many streams) in bf16 dot products
// (AVX512-BF16's vdpbf16ps: 32 products a vector, twice fp32's fma): y[M, N] = x[M, K] @
// dequant(w)[N, K]^T + bias, w ~ q * scale + min in groups of 32 along K.
//
// Precision is bf16's: each weight q * scale + min (the fp32 of linear_q8.c) and each x are
// rounded to bf16 (8 significant bits), their products summed in fp32. The weights are already
// 4- or 8-bit groups: rounding the dequantized weight moves it by at most 1/512 of itself.
//
// Each thread converts a block of weight rows to bf16 once and runs a chunk of x rows (bf16,
// converted once a call) past it, four x rows by four weight rows a tile whose 16 sums reduce
// together (sum16), as linear_q8.c's block path does in fp32. A row's bits do not depend on the
// other rows of the call, but differ from linear_q8.c's. Up to loom_linear_q8_direct_rows rows
// run linear_q8.c's direct path (decode of a few streams is bound by reading weights, not by
// products).

// Built without fast math (loom/kernels/build.py).

#include <stdint.h>
#include <stdlib.h>
#include "loom.h"
#include "loom_omp.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16 1
#include <immintrin.h>
#include "bf16_tile.h"  // bf16_tile, sum16
#include "grid_group.h"  // loom_grid_group
#endif

#define GROUP 32
#define BLOCK_BYTES (128 * 1024)  // converted block (bf16), per thread
#define X_BYTES (512 * 1024)      // x rows (bf16) a pass: with the block, within L2


// 1 if this build has the bf16 kernel (the compiler targets AVX512-BF16), 0 if not.
int loom_bf16_available(void)
{
#ifdef HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_BF16
// Group g of weight row q (K weights) as 32 bf16 at out: q * s + m in fp32 (linear_q8.c's
// weights: loom_grid_group), then rounded to nearest even.
static inline __attribute__((always_inline)) void group_bf16(const uint8_t *q, int bits,
                                                             int64_t K, int64_t g, float s,
                                                             float m, uint16_t *out)
{
    __m512 lo, hi;
    loom_grid_group(q, bits, K, g, s, m, &lo, &hi);
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Rows m0 .. m1 - 1 of x (bf16, K a row) past weight rows n0 .. n0 + nb - 1, converted to bf16
// in wbuf first: y rows m0 .. m1 - 1, columns n0 .. n0 + nb - 1.
static void block_pass(const uint16_t *xb, int64_t m0, int64_t m1, int64_t K, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int64_t n0, int64_t nb_rows,
                       uint16_t *wbuf)
{
    const int64_t row_bytes = K * LOOM_Q8_WIDTH(bits) / 8, groups = K / GROUP;
    const int64_t nb = N - n0 < nb_rows ? N - n0 : nb_rows;
    for (int64_t r = 0; r < nb; r++)
        for (int64_t g = 0; g < groups; g++)
            group_bf16(w + (n0 + r) * row_bytes, bits, K, g, scales[(n0 + r) * groups + g],
                       loom_q8_min(mins, scales, (n0 + r) * groups + g, bits),
                       wbuf + r * K + g * GROUP);
    const int64_t nbp = (nb + 3) / 4 * 4;
    for (int64_t i = nb * K; i < nbp * K; i++) wbuf[i] = 0;
    for (int64_t m = m0; m < m1; m += 4) {
        const int64_t mr = m1 - m < 4 ? m1 - m : 4;
        for (int64_t r = 0; r < nbp; r += 4) {
            float t[16];
            const uint16_t *xr = xb + m * K, *wr = wbuf + r * K;
            switch (mr) {
            case 4: bf16_tile(xr, K, 4, wr, K, t); break;
            case 3: bf16_tile(xr, K, 3, wr, K, t); break;
            case 2: bf16_tile(xr, K, 2, wr, K, t); break;
            default: bf16_tile(xr, K, 1, wr, K, t); break;
            }
            const int64_t cols = nb - r < 4 ? nb - r : 4;
            for (int64_t i = 0; i < mr; i++)
                for (int64_t j = 0; j < cols; j++)
                    y[(m + i) * ldy + n0 + r + j] =
                        t[4 * i + j] + (bias ? bias[n0 + r + j] : 0.0f);
        }
    }
}

// x rows m0 .. m1 - 1 (ldx floats apart) into xb as bf16, K a row, rounded to nearest even.
static void rows_bf16(const float *x, int64_t m0, int64_t m1, int64_t K, int64_t ldx,
                      uint16_t *xb)
{
    for (int64_t m = m0; m < m1; m++)
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512(xb + m * K + k,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ldx + k + 16),
                                                             _mm512_loadu_ps(x + m * ldx + k)));
}

// The blocking of a call: weight rows a block (*nb_rows) and blocks (returned) for `threads`
// threads, x rows a pass over them (*m_chunk).
static int64_t blocking(int64_t N, int64_t K, int threads, int64_t *nb_rows, int64_t *m_chunk)
{
    *m_chunk = (X_BYTES / 2) / K & ~(int64_t)3;
    *m_chunk = *m_chunk < 16 ? 16 : *m_chunk;
    return loom_weight_blocks(N, BLOCK_BYTES / 2 / K, 4, threads, nb_rows);
}

// A block's bf16 buffer for rows of up to K (blocking's *nb_rows, padded to 4): bytes.
static size_t block_buffer_bytes(int64_t K)
{
    return (size_t)(BLOCK_BYTES / 2 / K + 3 + 4) * K * sizeof(uint16_t);
}
#endif

// For loom_linear_q8_bf16_team in a thread of a team: reserves the calling thread's block
// buffer for rows of up to K_max. 0, -2 if it cannot be allocated, -3 without the kernel.
int loom_linear_q8_bf16_reserve(int64_t K_max)
{
#ifdef HAVE_BF16
    // at least block_buffer_bytes(K) for every K up to K_max
    return loom_scratch(1, BLOCK_BYTES + (size_t)K_max * 7 * sizeof(uint16_t)) ? 0 : -2;
#else
    (void)K_max;
    return -3;
#endif
}

// Thread `tid` of a team of `team`'s share of x's M rows into xb (bf16, K a row): every thread
// calls it, then a barrier, before loom_linear_q8_bf16_team reads xb.
void loom_bf16_rows_team(const float *x, int64_t M, int64_t K, int64_t ldx, uint16_t *xb,
                         int tid, int team)
{
#ifdef HAVE_BF16
    rows_bf16(x, M * tid / team, M * (tid + 1) / team, K, ldx, xb);
#else
    (void)x; (void)M; (void)K; (void)ldx; (void)xb; (void)tid; (void)team;
#endif
}

// loom_linear_q8_bf16 past loom_linear_q8_direct_rows rows for a thread of an OpenMP team that
// is already running (decoder_q8.c), from x already in bf16 (xb, loom_bf16_rows_team): every
// thread calls it with the same arguments and `next` zeroed, after loom_linear_q8_bf16_reserve
// succeeded in it, and takes (x chunk, weight block) units one at a time from *next. The
// caller's barrier ends the op. loom_linear_q8_bf16 (below) is this in a region of its own.
void loom_linear_q8_bf16_team(const uint16_t *xb, int64_t M, int64_t K, const uint8_t *w,
                              const float *scales, const float *mins, const float *bias,
                              int64_t N, float *y, int64_t ldy, int bits, int64_t *next,
                              int team)
{
#ifdef HAVE_BF16
    int64_t nb_rows, m_chunk;
    const int64_t num_blocks = blocking(N, K, team, &nb_rows, &m_chunk);
    const int64_t units = (M + m_chunk - 1) / m_chunk * num_blocks;
    uint16_t *wbuf = loom_scratch(1, block_buffer_bytes(K));  // reserved: no failure
    for (int64_t u; (u = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < units;) {
        const int64_t m0 = u / num_blocks * m_chunk, m1 = m0 + m_chunk < M ? m0 + m_chunk : M;
        block_pass(xb, m0, m1, K, w, scales, mins, bias, N, y, ldy, bits,
                   u % num_blocks * nb_rows, nb_rows, wbuf);
    }
#else  // not reached: reserve fails
    (void)xb; (void)M; (void)K; (void)w; (void)scales; (void)mins; (void)bias; (void)N;
    (void)y; (void)ldy; (void)bits; (void)next; (void)team;
#endif
}

// As loom_linear_q8_f32 (same arguments), which it runs itself for up to
// loom_linear_q8_direct_rows rows. Returns 0; -1 on bad K or bits; -2 when a buffer cannot be
// allocated; -3 where this build has no bf16 kernel (loom_bf16_available).
int loom_linear_q8_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        const float *scales, const float *mins, const float *bias, int64_t N,
                        float *y, int64_t ldy, int bits, int num_threads)
{
    const int front = loom_linear_q8_front(x, M, K, ldx, w, scales, mins, bias, N, y, ldy, bits,
                                           num_threads);
    if (front <= 0) return front;
#ifdef HAVE_BF16
    // the team form above in a region of its own: x converted a share a thread, then (x rows,
    // weight block) units from one counter
    uint16_t *xb = loom_scratch(0, (size_t)M * K * sizeof(uint16_t));
    if (!xb) return -2;
    int64_t next = 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int team = omp_get_num_threads();
        loom_bf16_rows_team(x, M, K, ldx, xb, omp_get_thread_num(), team);
        if (loom_linear_q8_bf16_reserve(K)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int skip;
#pragma omp atomic read
        skip = failed;
        if (!skip)
            loom_linear_q8_bf16_team(xb, M, K, w, scales, mins, bias, N, y, ldy, bits, &next,
                                     team);
    }
    return failed ? -2 : 0;
#else
    return -3;
#endif
}
