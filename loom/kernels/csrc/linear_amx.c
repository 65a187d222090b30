// The int8 linear of linear_q8.c for many rows (prefill, many streams) on AMX tiles:
// y[M, N] = x[M, K] @ dequant(w)[N, K]^T + bias, w ~ q * scale + min in groups of 32 along K.
//
// Precision is fp32's, not bf16's. q (0..255) is an integer, exact in bf16, so the weight tile
// holds q itself (less a center, see CENTER); each x is split into x_hi = bf16(x) and x_lo =
// bf16(x - x_hi) (16 significant bits) and both go through the same tile of sums, so
// TDPBF16PS sums q * x in fp32 for one group of 32 at a time. Each group's sum then takes its
// scale, and its minimum times the group's sum of x, in fp32:
// y = sum_g scale_g * sum_k q_k x_k + min_g * sum_k x_k.
//
// The tiles run weights as A (16 weight rows x 32 k, bf16 q in rows of a per-thread slab) and
// activations as B (16 k pairs x 16 x rows, pairs interleaved), so the weights need no
// transposing: C[n][m] is a 16 x 16 block of y transposed, kept in 16 registers across the
// groups and written back transposed at the end. A row's result does not depend on the other
// rows of the call (each C element reads its own row of A and column of B), but its summation
// order differs from linear_q8.c's: a request's bits then depend on whether its step had more
// than 8 rows.

// Built without fast math (loom/kernels/build.py).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "loom.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include "grid_group.h"  // loom_q5_bytes
#include <unistd.h>
#endif

#define GROUP 32
#define TILE 16  // rows of a tile, weight rows and x rows a block
#define X_BYTES (1024 * 1024)  // x tiles a pass (see loom_linear_q8_amx)
// The tiles take q - CENTER, the fold min + CENTER * scale: the same weights, and q * x and
// min * sum(x) no longer nearly cancel (they did, and lost digits, for 8-bit groups).
#define CENTER(bits) ((bits) == 4 ? 8 : (bits) == LOOM_Q8_Q5 ? 16 : 128)  // and LEVELS: 128

// 1 if AMX tiles can run in this process (the CPU and the compiler have them and Linux grants
// the tile state: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), 0 if not.
int loom_amx_available(void)
{
#ifdef HAVE_AMX
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// Tiles: 0 C (fp32 16 x 16), 1 A (weights), 2 x_hi, 3 x_lo; each 16 rows of 64 bytes.
static void tiles_configure(void)
{
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = TILE;
    }
    _tile_loadconfig(&cfg);
}

// 16 values q - center (q 0..255) as floats: integers, exact in bf16 too.
static inline __m512 centered(__m128i q, int center)
{
    const __m512i v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(center));
    return _mm512_cvtepi32_ps(v);
}

// Weight rows n0 .. n0 + 15 (zeros past N) as bf16 q - CENTER(bits) into slab [K / 32][16][32]
// (each group's A tile one contiguous KiB), and their scales and folded minimums group-major:
// sc[g][n] = scale, mc[g][n] = min + CENTER * scale (zeros past N).
static void slab_fill(const uint8_t *w, const float *scales, const float *mins, int bits,
                      int64_t K, int64_t n0, int64_t N, uint16_t *slab, float *sc, float *mc)
{
    const int64_t row_bytes = K * LOOM_Q8_WIDTH(bits) / 8, groups = K / GROUP;
    for (int64_t r = 0; r < TILE; r++) {
        if (n0 + r >= N) {
            for (int64_t g = 0; g < groups; g++) {
                memset(slab + (g * TILE + r) * GROUP, 0, GROUP * sizeof *slab);
                sc[g * TILE + r] = mc[g * TILE + r] = 0.0f;
            }
            continue;
        }
        const uint8_t *q = w + (n0 + r) * row_bytes;
        for (int64_t g = 0; g < groups; g++) {
            __m128i lo, hi;  // values 0..15 and 16..31 of the group
            if (bits == 8) {
                lo = _mm_loadu_si128((const __m128i *)(q + g * GROUP));
                hi = _mm_loadu_si128((const __m128i *)(q + g * GROUP + 16));
            } else {  // GGUF's nibbles: low = values 0..15, high = 16..31
                const __m128i b = _mm_loadu_si128((const __m128i *)(q + g * GROUP / 2));
                lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
                hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
                if (bits & LOOM_Q8_LEVELS) {  // the nibbles' values: IQ4_NL's levels + 128
                    const __m128i t = _mm_loadu_si128((const __m128i *)loom_iq4_q);
                    lo = _mm_shuffle_epi8(t, lo);
                    hi = _mm_shuffle_epi8(t, hi);
                }
                if (bits == LOOM_Q8_Q5) {  // + 16 by each fifth bit
                    const uint32_t h = loom_q5_high(q, K, g);
                    lo = _mm_or_si128(lo, loom_q5_bytes(h));
                    hi = _mm_or_si128(hi, loom_q5_bytes(h >> 16));
                }
            }
            _mm512_storeu_si512(slab + (g * TILE + r) * GROUP,
                                (__m512i)_mm512_cvtne2ps_pbh(centered(hi, CENTER(bits)),
                                                             centered(lo, CENTER(bits))));
            const int64_t at = (n0 + r) * groups + g;
            sc[g * TILE + r] = scales[at];
            mc[g * TILE + r] = __builtin_fmaf((float)CENTER(bits), scales[at],
                                              loom_q8_min(mins, scales, at, bits));
        }
    }
}

// 32 floats (two vectors) -> 32 bf16, rounded to nearest even; and back to fp32.
static inline __m512i to_bf16(__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }
static inline __m512 low_f32(__m512i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); }

// x rows m0 .. m0 + 15 (zeros past M) as B tiles, group by group: hi and lo [groups][16 pairs]
// [16 rows][2], and each group's sum of x [groups][16].
static void x_block(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t m0,
                    uint16_t *hi, uint16_t *lo, float *xsum)
{
    const int64_t groups = K / GROUP;
    // pair r of a row lands r * TILE dwords on
    const __m512i pairs = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                            192, 208, 224, 240);
    for (int64_t g = 0; g < groups; g++)
        for (int64_t m = 0; m < TILE; m++) {
            __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
            if (m0 + m < M) {
                a = _mm512_loadu_ps(x + (m0 + m) * ldx + g * GROUP);
                b = _mm512_loadu_ps(x + (m0 + m) * ldx + g * GROUP + 16);
            }
            // bf16 pairs (x[2r], x[2r + 1]) as dwords: the even element in the low half
            const __m512i h = to_bf16(a, b);
            const __m512i l = to_bf16(_mm512_sub_ps(a, low_f32(_mm512_cvtepu16_epi32(
                                                            _mm512_castsi512_si256(h)))),
                                      _mm512_sub_ps(b, low_f32(_mm512_cvtepu16_epi32(
                                                            _mm512_extracti64x4_epi64(h, 1)))));
            _mm512_i32scatter_epi32((int *)(hi + g * GROUP * TILE) + m, pairs, h, 4);
            _mm512_i32scatter_epi32((int *)(lo + g * GROUP * TILE) + m, pairs, l, 4);
            xsum[g * TILE + m] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
}

// One 16 x 16 block of y: weight rows n0.. (slab, sc and mc from slab_fill) against x rows
// m0.. (B tiles). All 16 weight rows always (padding rows have zero weights and scales): a
// constant count keeps the 16 sums in registers.
static void block(const uint16_t *slab, const float *sc, const float *mc, const uint16_t *hi,
                  const uint16_t *lo, const float *xsum, const float *bias, int64_t K,
                  int64_t n0, int64_t N, int64_t m0, int64_t M, float *y, int64_t ldy)
{
    const int64_t groups = K / GROUP;
    float c[TILE * TILE] __attribute__((aligned(64)));
    __m512 acc[TILE];
#pragma GCC unroll 16
    for (int n = 0; n < TILE; n++) acc[n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        _tile_loadd(1, slab + g * TILE * GROUP, 64);
        _tile_loadd(2, hi + g * GROUP * TILE, 64);
        _tile_loadd(3, lo + g * GROUP * TILE, 64);
        _tile_zero(0);
        _tile_dpbf16ps(0, 1, 2);
        _tile_dpbf16ps(0, 1, 3);
        _tile_stored(0, c, 64);
        const __m512 xs = _mm512_loadu_ps(xsum + g * TILE);
#pragma GCC unroll 16
        for (int n = 0; n < TILE; n++) {
            acc[n] = _mm512_fmadd_ps(_mm512_load_ps(c + n * TILE),
                                     _mm512_set1_ps(sc[g * TILE + n]), acc[n]);
            acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(mc[g * TILE + n]), xs, acc[n]);
        }
    }
#pragma GCC unroll 16
    for (int n = 0; n < TILE; n++) _mm512_store_ps(c + n * TILE, acc[n]);
    const int rows = N - n0 < TILE ? (int)(N - n0) : TILE;
    const int64_t ms = M - m0 < TILE ? M - m0 : TILE;
    for (int64_t m = 0; m < ms; m++)
        for (int n = 0; n < rows; n++)
            y[(m0 + m) * ldy + n0 + n] = c[n * TILE + m] + (bias ? bias[n0 + n] : 0.0f);
}
#endif

// As loom_linear_q8_f32 (same arguments), which it runs itself for up to
// loom_linear_q8_direct_rows rows (decode of a few streams: weights converted in registers,
// read once). Returns 0; -1 on bad K or bits; -2 when a buffer cannot be allocated; -3 where AMX
// cannot run (loom_amx_available).
int loom_linear_q8_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads)
{
    const int front = loom_linear_q8_front(x, M, K, ldx, w, scales, mins, bias, N, y, ldy, bits,
                                           num_threads);
    if (front <= 0) return front;
    if (!loom_amx_available()) return -3;
#ifdef HAVE_AMX
    // x rows a pass: their tiles (hi and lo) within X_BYTES, so they stay in L2 (2 MiB a core
    // on AMX CPUs) while every weight block runs past them. At 512 KiB a 128-token prompt
    // took two passes through a 1536-wide layer, each converting its weights again: 1 MiB,
    // one pass, measured 0.88x that layer.
    int64_t chunk = X_BYTES / (K * 4) / TILE;
    chunk = chunk < 1 ? 1 : chunk;  // m-blocks a pass
    const int64_t mblocks = (M + TILE - 1) / TILE, nblocks = (N + TILE - 1) / TILE;
    chunk = chunk < mblocks ? chunk : mblocks;
    const int64_t per_block = K * TILE;  // bf16 values of one x block (hi or lo)
    const int64_t xs_block = K / GROUP * TILE;  // group sums of one x block
    uint16_t *xt = loom_scratch(0, (size_t)chunk * per_block * 2 * sizeof(uint16_t));
    float *xsum = loom_scratch(1, (size_t)chunk * xs_block * sizeof(float));
    int failed = !xt || !xsum;
    if (!failed) {
#pragma omp parallel num_threads(num_threads)
        {
            // the weight block's slab, then its scales and folded minimums (slab_fill)
            uint16_t *slab = loom_scratch(2, (size_t)TILE * K * (sizeof(uint16_t) + 2 * sizeof(float)));
            float *sc = (float *)(slab + TILE * K), *mc = sc + K / GROUP * TILE;
            if (!slab) {
#pragma omp atomic write
                failed = 1;
            }
            tiles_configure();
            for (int64_t mb0 = 0; mb0 < mblocks; mb0 += chunk) {
                const int64_t mbs = mblocks - mb0 < chunk ? mblocks - mb0 : chunk;
#pragma omp for schedule(static)
                for (int64_t i = 0; i < mbs; i++)
                    x_block(x, M, K, ldx, (mb0 + i) * TILE, xt + 2 * i * per_block,
                            xt + (2 * i + 1) * per_block, xsum + i * xs_block);
#pragma omp for schedule(dynamic, 1)
                for (int64_t nb = 0; nb < nblocks; nb++) {
                    if (!slab) continue;
                    slab_fill(w, scales, mins, bits, K, nb * TILE, N, slab, sc, mc);
                    for (int64_t i = 0; i < mbs; i++)
                        block(slab, sc, mc, xt + 2 * i * per_block, xt + (2 * i + 1) * per_block,
                              xsum + i * xs_block, bias, K, nb * TILE, N, (mb0 + i) * TILE, M, y,
                              ldy);
                }
            }
            _tile_release();
        }
    }
    return failed ? -2 : 0;
#else
    return -3;  // not reached: loom_amx_available() is 0
#endif
}
