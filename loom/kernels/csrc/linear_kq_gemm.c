// K-quant linears past 8 rows (prompts, steps of many streams): y[M, N] = x[M, K] W^T + bias, W
// as GGUF stores it (Q2_K to Q6_K super-blocks, linear_kquant.c's layouts). The integer
// kernel of linear_kquant.c unpacks each weight once per 8 rows and is then bound by
// instructions; here each thread unpacks a panel of weight rows (up to KC columns of them) once
// into a buffer of its own that stays in L2, and runs every x row past it:
// - AVX512-BF16: the panels hold the dequantized weights in bf16, x is rounded to bf16, and
//   vdpbf16ps sums 32 products a vector in fp32 (linear_bf16.c's tile).
// - AVX2 (and the AVX-512 builds without BF16): the panels hold each weight's integers with its
//   6-bit sub-block scale applied, sc q (Q4_K, Q5_K: <= 1953) or sc (q - 32) (Q6_K: |.| <= 4096),
//   in int16; x is rounded to one int16 a super-block (X = x / dx, dx = max |x| / 32767);
//   vpmaddwd multiplies 16 pairs an instruction, a super-block's products are summed in int32
//   (exactly: Q6_K's every 128 values) and converted once, times d dx, and Q4_K's / Q5_K's
//   minimums come off as one 8-lane product of the sub-blocks' dmin m and dx sum X (Q2_K, whose
//   minimums come a run of 16: its weights rounded to 13-bit integers a super-block, q2_grid,
//   as the int8 grid's are). The same
//   rounding of x as one int16 per 256 values keeps a real model's greedy tokens (accuracy and
//   speed: docs/kquants.md).
// - Portable C: the `gguf` package's dequantized weights in fp32 and x as given.
// The AVX2 int16 tile runs Loom's int8 grid too (loom_linear_q8_i16, at the end): its weights
// rounded to 13-bit integers a super-block (grid_row).
// Order: each output is the sum over K chunks of KC (in order) of a chunk's tile sum, then the
// bias: the same whatever M, so a row's bits do not depend on the other rows of its call
// (they differ from linear_kquant.c's, whose kernel up to 8 rows this file calls as it is).
//
// Built without fast math (loom/kernels/build.py).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kquant_blocks.h"  // QK, the formats, f16_at, block_scales
#include "loom.h"
#include "loom_omp.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KG_BF16 1
#include <immintrin.h>
#include "bf16_tile.h"  // linear_bf16.c's tile
#include "grid_group.h"  // loom_q5_bytes
#elif defined(__AVX2__) && defined(__FMA__)
#define KG_I16 1
#include <immintrin.h>
#include "grid_group.h"  // loom_q5_bytes
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// the vnni build: the same panels and x in 512-bit tiles of vpdpwssd (the avx512 build keeps
// the AVX2 tile: 512-bit vpmaddwd + vpaddd took 1.05x its time on Q4_K, 1.02-1.08x on the int8
// grid, on a Zen 4)
#define KG_I16_512 1
#endif
#if defined(__GNUC__) && !defined(__clang__)
// gcc 12 otherwise keeps the tile's int32 sums in two registers each and copies them every step
// (benchmarks/int16_tile.c: ~0.8x clang's rate without this)
#pragma GCC optimize("no-tree-coalesce-vars")
#endif
#endif

#define ROWS_INT 8       // loom_linear_kq's rows (its integer kernel) up to this many
#define PANEL_BYTES (128 * 1024)  // a thread's unpacked panel: with x's rows, within L2
#define X_BYTES (512 * 1024)      // x rows a pass over the panels (a chunk of KC columns each)

#if defined(KG_BF16)
typedef uint16_t panel_t;  // bf16
#define KC 2048            // K columns a panel
#define TN 4               // panel rows a tile
#define TM 4               // x rows a tile
#elif defined(KG_I16)
typedef int16_t panel_t;
#define KC 2048
#define TN 2
#define TM 4
// floats of side values a (row, super-block), for panel rows and x rows alike: 8 sub-block
// terms (Q4_K's / Q5_K's minimums: dmin m in the panel, dx sum X in x), then the scale (d, dx)
#define SIDE 16
#else
typedef float panel_t;
#define KC 1024
#define TN 4
#define TM 1
#endif
#ifndef SIDE
#define SIDE 0
#endif
// a panel row's bytes over kc columns: its values and its super-blocks' side values
#define ROW_BYTES(kc) ((kc) * (int64_t)sizeof(panel_t) + (kc) / QK * SIDE * (int64_t)sizeof(float))
// The int8 grid's integers (loom_linear_q8_i16): weights in 13 bits (|W| <= 4095) against x in 15
// (|X| <= 16383), so a super-block's 16 vpmaddwd a lane sum exactly in int32 (2 x 4095 x 16383
// x 16 < 2^31). 12-bit weights against 16-bit x fell below the 99% bar on the default model; the
// other splits passed (docs/cpu_kernels.md). x keeps 15 bits against activation outliers, which
// a super-block's one scale shares with 255 other values.
#define GRID_W 4095.0f
#define GRID_X 16383.0f
#define GRID 0  // Src's fmt for Loom's int8 grid (loom_linear_q8_i16), beside ggml's K-quant ids
#define PAD(K) (((K) + QK - 1) / QK * QK)  // K as the panels and x's int16 rows hold it

// The weights a call unpacks: K-quant blocks (fmt Q2_K to Q6_K: w) or, in the int16
// build, the int8 grid (fmt GRID: w [N, K bits / 8], s and m [N, K / 32], loom.h's int8-grid
// layout).
typedef struct {
    const uint8_t *w;
    int fmt;
    const float *s, *m;
    int bits;
} Src;

// Which kernel this build runs past 8 rows: 2 AVX512-BF16, 1 AVX2 int16, 0 portable fp32.
int loom_kq_gemm_isa(void)
{
#if defined(KG_BF16)
    return 2;
#elif defined(KG_I16)
    return 1;
#else
    return 0;
#endif
}

// ---- dequantizing a panel ------------------------------------------------------------------

#if defined(KG_BF16) || defined(KG_I16)
#if defined(KG_BF16)
// Q4_K's / Q5_K's sub-block scales s[j] = d sc[j] and minimums m[j] = dmin mn[j] (j < 8):
// k4_words, then 8 lanes at a time.
static inline void k45_scales(const uint8_t *blk, float s[8], float m[8])
{
    uint64_t sc, mn;
    k4_words(blk + 4, &sc, &mn);
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                          _mm_cvtsi64_si128((long long)sc))),
                                      _mm256_set1_ps(f16_at(blk))));
    _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                          _mm_cvtsi64_si128((long long)mn))),
                                      _mm256_set1_ps(f16_at(blk + 2))));
}

// A super-block's scale sw[h] and offset ow[h] for each run h of 16 weights: w = sw q - ow
// (block_scales' values; Q4_K's / Q5_K's in SIMD).
static inline void sb_scales(const uint8_t *blk, int fmt, float sw[16], float ow[16])
{
    if (fmt == Q6_K) {  // block_scales' d sc[h] and 32 d sc[h], 8 runs at a time
        const __m256 d = _mm256_set1_ps(f16_at(blk + 208));
        for (int h = 0; h < 16; h += 8) {
            const __m128i sc = _mm_loadl_epi64((const __m128i *)(blk + 192 + h));  // int8
            const __m256 s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            _mm256_storeu_ps(sw + h, s);
            _mm256_storeu_ps(ow + h, _mm256_mul_ps(_mm256_set1_ps(32.0f), s));
        }
        return;
    }
    if (fmt == Q2_K || fmt == Q3_K) {
        block_scales(blk, fmt, sw, ow);
        return;
    }
    float s[8], m[8];
    k45_scales(blk, s, m);
    for (int j = 0; j < 8; j++) {
        sw[2 * j] = sw[2 * j + 1] = s[j];
        ow[2 * j] = ow[2 * j + 1] = m[j];
    }
}
#endif

// Q2_K's weights 128 c + 32 t .. + 31 (t < 4) as bytes: bits 2t, 2t + 1 of qs[32 c ..] (laid
// out as Q6_K's qh).
static inline __m256i q2_bytes(const uint8_t *blk, int c, int t)
{
    const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
    return _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
}

// Q3_K's weights 128 c + 32 t .. + 31 as bytes 0..7: Q2_K's two bits (its qs at 32) and the
// third, bit 4c + t of the first 32 bytes.
static inline __m256i q3_bytes(const uint8_t *blk, int c, int t)
{
    const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * c));
    const __m256i HM = _mm256_loadu_si256((const __m256i *)blk);
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * t)),
                                        _mm256_set1_epi8(3));
    const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(HM, _mm_cvtsi32_si128(4 * c + t)),
                                        _mm256_set1_epi8(1));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2));
}

// Q6_K's weights 128 c + 32 t .. + 31 (t < 4) as bytes: the nibbles of ql[64 c + 32 (t % 2) ..]
// (low for t < 2, high after), bits 4-5 from qh[32 c ..] >> 2 t.
static inline __m256i q6_bytes(const uint8_t *blk, int c, int t)
{
    const __m256i L = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * (t & 1)));
    const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
    const __m256i nib = _mm256_and_si256(t & 2 ? _mm256_srli_epi16(L, 4) : L,
                                         _mm256_set1_epi8(15));
    const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * t)),
                                        _mm256_set1_epi8(3));
    return _mm256_or_si256(nib, _mm256_slli_epi16(hb, 4));
}

#if defined(KG_BF16)
// A super-block's 256 unsigned integers in weight order into q (AVX2, 32 a vector; the int16
// build's panel_row reads them from the block into its lanes itself).
static inline void sb_values(const uint8_t *blk, int fmt, uint8_t *q)
{
    const __m256i low4 = _mm256_set1_epi8(15);
    if (runs16(fmt)) {
        for (int c = 0; c < 2; c++)
            for (int t = 0; t < 4; t++)
                _mm256_storeu_si256((__m256i *)(q + 128 * c + 32 * t),
                                    fmt == Q6_K   ? q6_bytes(blk, c, t)
                                    : fmt == Q3_K ? q3_bytes(blk, c, t)
                                                  : q2_bytes(blk, c, t));
        return;
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16);
    const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 16));  // Q5_K's fifth bits
    for (int t = 0; t < 8; t++) {  // weights 32t ..: nibbles of qs[32 (t / 2) ..], bit t of qh
        const __m256i L = _mm256_loadu_si256((const __m256i *)(qs + 32 * (t / 2)));
        __m256i v = _mm256_and_si256(t & 1 ? _mm256_srli_epi16(L, 4) : L, low4);
        if (fmt == Q5_K) {
            const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(t)),
                                                _mm256_set1_epi8(1));
            v = _mm256_or_si256(v, _mm256_slli_epi16(hb, 4));
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * t), v);
    }
}

// A Q4_K / Q5_K super-block as 256 bf16 at out: a sub-block of 32 weights (one scale and
// minimum) is a table of its 16 (Q4_K) or 32 (Q5_K) values sw q - ow (one rounding, then bf16)
// that its integers look up (vpermw).
static inline void k45_bf16(const uint8_t *blk, int fmt, uint16_t *out)
{
    float s[8], m[8];
    k45_scales(blk, s, m);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.0f));
    const __m512i low4 = _mm512_set1_epi16(15), bit4 = _mm512_set1_epi16(16);
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16);
    // Q5_K's fifth bits: bit j of byte l is weight 32 j + l's; a 16-bit lane l holds byte l
    const __m512i H = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16)));
    for (int c = 0; c < 4; c++) {  // bytes 32c ..: weights 64c + l (low nibbles), 64c + 32 + l
        const __m512i L = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        for (int j = 2 * c; j < 2 * c + 2; j++) {
            __m512i idx = _mm512_and_si512(j & 1 ? _mm512_srli_epi16(L, 4) : L, low4);
            const __m512 sj = _mm512_set1_ps(s[j]), mj = _mm512_set1_ps(m[j]);
            const __m512 lo = _mm512_fmsub_ps(iota, sj, mj);
            __m512i table;
            if (fmt == Q5_K) {
                const __m512i hb = j <= 4 ? _mm512_sll_epi16(H, _mm_cvtsi32_si128(4 - j))
                                          : _mm512_srl_epi16(H, _mm_cvtsi32_si128(j - 4));
                idx = _mm512_or_si512(idx, _mm512_and_si512(hb, bit4));
                table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(iota16, sj, mj), lo);
            } else {
                table = (__m512i)_mm512_cvtne2ps_pbh(lo, lo);
            }
            _mm512_storeu_si512(out + 32 * j, _mm512_permutexvar_epi16(idx, table));
        }
    }
}
#endif

#endif  // KG_BF16 || KG_I16

#if defined(KG_BF16)
// Columns [k0, k0 + kc) of weight row n as panel values at out: sw q - ow in one rounding (the
// `gguf` package's fp32 values), then bf16 (nearest even). (side: none in this build)
static void panel_row(const uint8_t *w, int fmt, int64_t K, int64_t n, int64_t k0, int64_t kc,
                      panel_t *out, float *side)
{
    (void)side;
    const int bb = loom_kq_block_bytes(fmt);
    const int64_t row = K / QK * bb;  // bytes: the next row's block is `row` past this one
    const uint8_t *blk = w + (n * (K / QK) + k0 / QK) * bb;
    for (int64_t s = 0; s < kc / QK; s++, blk += bb, out += QK) {
        // the panel reads a chunk of a row, then the next row's: the hardware prefetchers miss
        // that stride (and Q6_K's scales sit at a block's end: read first, a miss a block)
        for (int i = 0; i < bb; i += 64) __builtin_prefetch(blk + row + i);
        if (!runs16(fmt)) {
            k45_bf16(blk, fmt, out);
            continue;
        }
        float sw[16], ow[16];
        uint8_t q[QK] __attribute__((aligned(32)));
        sb_scales(blk, fmt, sw, ow);
        sb_values(blk, fmt, q);
        for (int h = 0; h < 16; h += 2) {
            const __m512 a = _mm512_fmsub_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_load_si128((const __m128i *)(q + 16 * h)))),
                _mm512_set1_ps(sw[h]), _mm512_set1_ps(ow[h]));
            const __m512 b = _mm512_fmsub_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_load_si128((const __m128i *)(q + 16 * h + 16)))),
                _mm512_set1_ps(sw[h + 1]), _mm512_set1_ps(ow[h + 1]));
            _mm512_storeu_si512(out + 16 * h, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

#elif defined(KG_I16)
// A Q2_K super-block as int16 at out (its SIDE floats at side): each run's minimum is its own
// (dmin m a run of 16, where the tile's minimum terms take one a sub-block of 32), so the
// weights w = d sc q - dmin m are rounded to W = w / D (nearest even), D = B / 4095 with B the
// largest |w| the runs' scales and minimums allow (q = 0 or 3), as grid_row rounds the int8
// grid: W = q (sw / D) - ow / D in one fma, within 1/8190 of B plus an fp32 rounding (B: of the
// order of the widest run's three steps and largest minimum; a run of scale 1 of 15 sees ~1/180
// of its step).
// side[8] = D, side[0..7] zero: the tile's Q6 mode (no minimum term; its sums of 128 products a
// lane stay below 2^31 at |W| <= 4095).
static void q2_grid(const uint8_t *blk, int16_t *out, float *side)
{
    float sw[16], ow[16], bound = 0.0f;
    block_scales(blk, Q2_K, sw, ow);
    for (int h = 0; h < 16; h++) {
        const float lo = fabsf(ow[h]), hi = fabsf(3.0f * sw[h] - ow[h]);
        bound = bound > lo ? bound : lo;
        bound = bound > hi ? bound : hi;
    }
    const float inv = bound > 0 ? 4095.0f / bound : 0.0f;
    for (int c = 0; c < 2; c++)
        for (int t = 0; t < 4; t++) {  // weights 128c + 32t ..: runs 8c + 2t, + 1
            const __m256i v = q2_bytes(blk, c, t);
            for (int u = 0; u < 2; u++) {
                const int h = 8 * c + 2 * t + u;
                const __m128i b = u ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
                const __m256 s = _mm256_set1_ps(sw[h] * inv), o = _mm256_set1_ps(-ow[h] * inv);
                const __m256i a = _mm256_cvtps_epi32(
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), s, o));
                const __m256i d = _mm256_cvtps_epi32(_mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), s, o));
                _mm256_storeu_si256((__m256i *)(out + 16 * h),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(a, d), 0xD8));
            }
        }
    memset(side, 0, 8 * sizeof(float));
    side[8] = bound / 4095.0f;
}

// Columns [k0, k0 + kc) of weight row n as int16 at out, and each super-block's SIDE floats at
// side: weight i of a super-block is side[8] out[i] - side[i / 32] in Q4_K / Q5_K (d, sc q,
// dmin m), side[8] out[i] in Q6_K (d, sc (q - 32); its side[0..7] zero), Q3_K (d, (s - 32)
// (q - 4), |.| <= 128) and Q2_K (q2_grid).
static void panel_row(const uint8_t *w, int fmt, int64_t K, int64_t n, int64_t k0, int64_t kc,
                      panel_t *out, float *side)
{
    const int bb = loom_kq_block_bytes(fmt);
    const int64_t row = K / QK * bb;
    const uint8_t *blk = w + (n * (K / QK) + k0 / QK) * bb;
    const __m256i low4 = _mm256_set1_epi8(15);
    // the integers straight from the block's bytes into int16 lanes and times their scale in
    // registers, not through a buffer of them (sb_values'; docs/kquants.md: the time)
    for (int64_t s = 0; s < kc / QK; s++, blk += bb, out += QK, side += SIDE) {
        for (int i = 0; i < bb; i += 64) __builtin_prefetch(blk + row + i);  // as above
        if (fmt == Q2_K) {
            q2_grid(blk, out, side);
            continue;
        }
        if (fmt == Q6_K || fmt == Q3_K) {  // sc (q - 32), Q3_K's (s - 32) (q - 4): exact
            int8_t sc[16];
            if (fmt == Q3_K)
                _mm_storeu_si128((__m128i *)sc, q3_scales128(blk));
            else
                memcpy(sc, blk + 192, 16);
            for (int c = 0; c < 2; c++)
                for (int t = 0; t < 4; t++) {  // weights 128c + 32t ..: runs 8c + 2t, + 1
                    const __m256i v = fmt == Q6_K
                        ? _mm256_sub_epi8(q6_bytes(blk, c, t), _mm256_set1_epi8(32))
                        : _mm256_sub_epi8(q3_bytes(blk, c, t), _mm256_set1_epi8(4));
                    const int h = 8 * c + 2 * t;
                    _mm256_storeu_si256((__m256i *)(out + 16 * h), _mm256_mullo_epi16(
                        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                        _mm256_set1_epi16(sc[h])));
                    _mm256_storeu_si256((__m256i *)(out + 16 * h + 16), _mm256_mullo_epi16(
                        _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                        _mm256_set1_epi16(sc[h + 1])));
                }
            memset(side, 0, 8 * sizeof(float));
            side[8] = f16_at(blk + (fmt == Q6_K ? 208 : 108));
            continue;
        }
        uint64_t sc, mn;
        k4_words(blk + 4, &sc, &mn);
        const float dmin = f16_at(blk + 2);
        const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16);
        const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 16));  // Q5_K's fifth bits
        for (int j = 0; j < 4; j++) {  // qs[32 j ..]: sub-blocks 2 j (low nibbles), 2 j + 1
            const __m256i L = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            for (int h = 0; h < 2; h++) {
                const int t = 2 * j + h;
                __m256i v = _mm256_and_si256(h ? _mm256_srli_epi16(L, 4) : L, low4);
                if (fmt == Q5_K)  // bit t of qh's bytes
                    v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(
                        _mm256_srl_epi16(H, _mm_cvtsi32_si128(t)), _mm256_set1_epi8(1)), 4));
                const __m256i scj = _mm256_set1_epi16((int16_t)(sc >> 8 * t & 0xff));
                _mm256_storeu_si256((__m256i *)(out + 32 * t), _mm256_mullo_epi16(
                    _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), scj));
                _mm256_storeu_si256((__m256i *)(out + 32 * t + 16), _mm256_mullo_epi16(
                    _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), scj));
                side[t] = dmin * (float)(mn >> 8 * t & 0xff);
            }
        }
        side[8] = f16_at(blk);
    }
}

// Columns [k0, k0 + kc) of int8-grid row n as int16 at out, SIDE floats a super-block at side:
// a super-block's weights q s + m rounded to W = w / D (nearest even), D = B / GRID_W with B
// the largest |w| its groups' scales and minimums allow (|m| or |m + qmax s|: each group's
// extremes, which its own weights reach where they came from GGUF's blocks or Loom's
// quantizer), zero past K; side[8] = D, side[0..7] zero (no minimum term). W = q (s / D) +
// m / D in one fma: within 1/8190 of B plus an fp32 rounding, ~1/200 of a 4-bit group's step
// and ~1/16 of an 8-bit one's in the super-block's widest group.
static void grid_row(const Src *src, int64_t K, int64_t n, int64_t k0, int64_t kc, int16_t *out,
                     float *side)
{
    const int width = LOOM_Q8_WIDTH(src->bits);  // 8, 5 or 4 (LOOM_Q8_LEVELS: values 1..241)
    const int64_t groups = K / 32, row_bytes = K * width / 8;
    const uint8_t *q = src->w + n * row_bytes;
    const float *s = src->s + n * groups, *m = src->m ? src->m + n * groups : NULL;
    const float qmax = src->bits == 4 ? 15.0f : src->bits == LOOM_Q8_Q5 ? 31.0f : 255.0f;
    for (int64_t c = k0; c < k0 + kc; c += QK, out += QK, side += SIDE) {
        // the panel reads a chunk of a row, then the next row's: ahead to the next row's
        for (int64_t i = 0; i < QK * width / 8; i += 64)  // (5-bit rows: about there)
            __builtin_prefetch(q + row_bytes + c * width / 8 + i);
        const int64_t have = K - c < QK ? K - c : QK;  // a multiple of 32
        float bound = 0.0f;
        for (int64_t g = c / 32; g < (c + have) / 32; g++) {
            const float mg = loom_q8_min(m, s, g, src->bits);
            const float lo = fabsf(mg), hi = fabsf(mg + qmax * s[g]);
            bound = bound > lo ? bound : lo;
            bound = bound > hi ? bound : hi;
        }
        const float inv = bound > 0 ? GRID_W / bound : 0.0f;
        for (int64_t j = 0; j < have; j += 16) {
            const int64_t k = c + j, g = k / 32;
            __m256i b0, b1;
            if (src->bits == 8) {
                const __m128i v = _mm_loadu_si128((const __m128i *)(q + k));
                b0 = _mm256_cvtepu8_epi32(v);
                b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
            } else {  // GGUF's nibbles: a group's values 0..15 low, 16..31 high, in 16 bytes
                const __m128i v = _mm_loadu_si128((const __m128i *)(q + g * 16));
                __m128i u = (k & 31) < 16 ? _mm_and_si128(v, _mm_set1_epi8(15))
                                          : _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
                if (src->bits & LOOM_Q8_LEVELS)  // the nibbles' values
                    u = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)loom_iq4_q), u);
                if (src->bits == LOOM_Q8_Q5)  // byte i: + 16 where bit k % 32 + i is set
                    u = _mm_or_si128(u, loom_q5_bytes(loom_q5_high(q, K, g) >> (k & 31)));
                b0 = _mm256_cvtepu8_epi32(u);
                b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(u, 8));
            }
            const __m256 sg = _mm256_set1_ps(s[g] * inv),
                         mg = _mm256_set1_ps(loom_q8_min(m, s, g, src->bits) * inv);
            const __m256i a = _mm256_cvtps_epi32(_mm256_fmadd_ps(_mm256_cvtepi32_ps(b0), sg, mg));
            const __m256i d = _mm256_cvtps_epi32(_mm256_fmadd_ps(_mm256_cvtepi32_ps(b1), sg, mg));
            _mm256_storeu_si256((__m256i *)(out + j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(a, d), 0xD8));
        }
        for (int64_t j = have; j < QK; j += 16)
            _mm256_storeu_si256((__m256i *)(out + j), _mm256_setzero_si256());
        memset(side, 0, 8 * sizeof(float));
        side[8] = bound / GRID_W;
    }
}

// Row x (K values) as the int16 tiles read it: a super-block's 256 values as X = x / dx (nearest
// even), dx = max |x| / xmax (32767 against K-quants, GRID_X against the int8 grid), at X (zero
// past K, to PAD(K)); its SIDE floats at side: the 8 sub-blocks' dx sum X (what Q4_K's / Q5_K's
// minimums multiply), then dx.
static void x16_row(const float *x, int64_t K, float xmax, int16_t *X, float *side)
{
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t s = 0; s < K; s += QK, x += QK, X += QK, side += SIDE) {
        float tail[QK];
        const float *v = x;
        if (K - s < QK) {  // the last super-block of a K that is not a multiple of 256
            memcpy(tail, x, (size_t)(K - s) * sizeof(float));
            memset(tail + (K - s), 0, (size_t)(QK - (K - s)) * sizeof(float));
            v = tail;
        }
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < QK; i += 8)
            mx = _mm256_max_ps(mx, _mm256_and_ps(abs, _mm256_loadu_ps(v + i)));
        const float amax = hmax8(mx);
        const float dx = amax / xmax;
        const __m256 id = _mm256_set1_ps(amax > 0 ? xmax / amax : 0.0f);
        for (int j = 0; j < 8; j++) {
            __m256i a[4];
            for (int t = 0; t < 4; t++)
                a[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * j + 8 * t), id));
            // vpackssdw packs within 128-bit lanes: 0xD8 puts the 64-bit quarters back in order
            _mm256_storeu_si256((__m256i *)(X + 32 * j), _mm256_permute4x64_epi64(
                _mm256_packs_epi32(a[0], a[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(X + 32 * j + 16), _mm256_permute4x64_epi64(
                _mm256_packs_epi32(a[2], a[3]), 0xD8));
            side[j] = dx * (float)hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(a[0], a[1]),
                                                               _mm256_add_epi32(a[2], a[3])));
        }
        side[8] = dx;
    }
}

#else
// Portable: linear_kquant.c's dequantizer (the same fp32 values).
static void panel_row(const uint8_t *w, int fmt, int64_t K, int64_t n, int64_t k0, int64_t kc,
                      panel_t *out, float *side)
{
    (void)side;
    const int64_t nsb = K / QK;
    loom_kq_dequant(w + (n * nsb + k0 / QK) * loom_kq_block_bytes(fmt), fmt, kc, 0, 1, out, kc);
}
#endif

// ---- tiles: TM x rows (R of them real) against TN panel rows over kc columns -----------------
enum { MIN, Q6, PLAIN };  // the int16 tile's modes (below)
// out[TN r + j] = x row r . panel row j (rows past R: not written). xs, ps: the rows' side
// values (the int16 build), lds and kc / QK SIDE floats a row.

#if defined(KG_BF16)
static inline __attribute__((always_inline)) void tile(const panel_t *x, int64_t ldx,
                                                       const float *xs, int64_t lds, const int R,
                                                       const panel_t *p, const float *ps,
                                                       int64_t kc, int64_t kn, const int mode,
                                                       float out[TM * TN])
{
    (void)xs, (void)lds, (void)ps, (void)kn, (void)mode;
    bf16_tile(x, ldx, R, p, kc, out);  // bf16_tile.h (linear_bf16.c's): TM = TN = 4
}

#elif defined(KG_I16_512)
// The int16 tile in 512-bit vectors: 32 products an instruction (vpdpwssd), a super-block's
// sums in int32 in every mode (Q6_K's 16 products a lane, |sc (q - 32)| <= 4096 against
// |X| <= 32767, stay below 2^31), then converted once; the minimums' 8 terms in the low 8
// lanes. The same integers as the AVX2 tile, other fp32 sums.
// (4 x 4 with the fp32 sums in memory took 1.15x this one's time on a Zen 4: a super-block's
// conversions, ~5 ops a sum, weigh as much as its 8 steps of products.)
static inline __attribute__((always_inline)) void tile(const panel_t *x, int64_t ldx,
                                                       const float *xs, int64_t lds, const int R,
                                                       const panel_t *p, const float *ps,
                                                       int64_t kc, int64_t kn, const int mode,
                                                       float out[TM * TN])
{
    __m512 acc[TM * TN];
    for (int i = 0; i < TM * TN; i++) acc[i] = _mm512_setzero_ps();
    const int64_t pside = kc / QK * SIDE;
    for (int64_t k0 = 0; k0 < kn; k0 += QK) {  // kn: past it the panel and x are zero
        __m512i ia[TM * TN];
        for (int i = 0; i < TM * TN; i++) ia[i] = _mm512_setzero_si512();
        for (int64_t k = k0, end = k0 + QK < kn ? k0 + QK : kn; k < end; k += 32) {
            const __m512i w0 = _mm512_loadu_si512((const void *)(p + k));
            const __m512i w1 = _mm512_loadu_si512((const void *)(p + kc + k));
            for (int r = 0; r < R; r++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(x + r * ldx + k));
                ia[2 * r] = _mm512_dpwssd_epi32(ia[2 * r], xv, w0);
                ia[2 * r + 1] = _mm512_dpwssd_epi32(ia[2 * r + 1], xv, w1);
            }
        }
        const int64_t sb = k0 / QK * SIDE;
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(xs[r * lds + sb + 8]);
            for (int j = 0; j < TN; j++)
                acc[TN * r + j] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(ia[TN * r + j]),
                    _mm512_mul_ps(dx, _mm512_set1_ps(ps[j * pside + sb + 8])),
                    acc[TN * r + j]);
        }
        if (mode == MIN)
            for (int r = 0; r < R; r++)
                for (int j = 0; j < TN; j++)
                    acc[TN * r + j] = _mm512_fnmadd_ps(
                        _mm512_maskz_loadu_ps(0xff, ps + j * pside + sb),
                        _mm512_maskz_loadu_ps(0xff, xs + r * lds + sb), acc[TN * r + j]);
    }
    for (int i = 0; i < TM * TN; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

#elif defined(KG_I16)
// Four vectors' sums as one 128-bit vector.
static inline __attribute__((always_inline)) __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

_Static_assert(TN == 2, "the int16 tile reads two panel rows");
static inline __attribute__((always_inline)) void tile(const panel_t *x, int64_t ldx,
                                                       const float *xs, int64_t lds, const int R,
                                                       const panel_t *p, const float *ps,
                                                       int64_t kc, int64_t kn, const int mode,
                                                       float out[TM * TN])
{
    __m256 acc[TM * TN];
    for (int i = 0; i < TM * TN; i++) acc[i] = _mm256_setzero_ps();
    // mode: MIN (Q4_K, Q5_K: a minimum term), Q6 (Q6_K, Q3_K, and Q2_K's 13-bit panels) or PLAIN
    // (the int8 grid's 13-bit panels).
    // Values summed in int32 between conversions: a super-block, Q6_K's half of one (its
    // |sc (q - 32)| <= 4096 times |X| <= 32767, 16 products a lane, fits 2^31 only so far)
    const int64_t run = mode == Q6 ? QK / 2 : QK, pside = kc / QK * SIDE;
    for (int64_t k0 = 0; k0 < kn; k0 += run) {  // kn: past it the panel and x are zero
        __m256i ia[TM * TN];
        for (int i = 0; i < TM * TN; i++) ia[i] = _mm256_setzero_si256();
        for (int64_t k = k0, end = k0 + run < kn ? k0 + run : kn; k < end; k += 16) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + k));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + kc + k));
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * ldx + k));
                ia[2 * r] = _mm256_add_epi32(ia[2 * r], _mm256_madd_epi16(xv, w0));
                ia[2 * r + 1] = _mm256_add_epi32(ia[2 * r + 1], _mm256_madd_epi16(xv, w1));
            }
        }
        const int64_t sb = k0 / QK * SIDE;
        for (int r = 0; r < R; r++) {
            const __m256 dx = _mm256_broadcast_ss(xs + r * lds + sb + 8);
            for (int j = 0; j < TN; j++)
                acc[TN * r + j] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(ia[TN * r + j]),
                    _mm256_mul_ps(dx, _mm256_broadcast_ss(ps + j * pside + sb + 8)),
                    acc[TN * r + j]);
        }
        if (mode == MIN)
            for (int r = 0; r < R; r++)
                for (int j = 0; j < TN; j++)
                    acc[TN * r + j] = _mm256_fnmadd_ps(_mm256_loadu_ps(ps + j * pside + sb),
                                                       _mm256_loadu_ps(xs + r * lds + sb),
                                                       acc[TN * r + j]);
    }
    for (int i = 0; i < TM * TN; i += 4)
        _mm_storeu_ps(out + i, sum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
}

#else
// Portable: 8 running sums a dot product (vectorizable lane-wise without reassociation).
static void tile(const panel_t *x, int64_t ldx, const float *xs, int64_t lds, const int R,
                 const panel_t *p, const float *ps, int64_t kc, int64_t kn, const int mode,
                 float out[TM * TN])
{
    (void)ldx, (void)xs, (void)lds, (void)R, (void)ps, (void)kn, (void)mode;
    for (int j = 0; j < TN; j++) {
        float acc[8] = {0};
        for (int64_t k = 0; k < kc; k += 8)
            for (int l = 0; l < 8; l++) acc[l] += x[k + l] * p[j * kc + k + l];
        out[j] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}
#endif

// ---- a call ----------------------------------------------------------------------------------

// Weight rows n0 .. n0 + nb - 1 of src against all M rows of x (xp: the tiles' x, ldp apart;
// xs: its side values, lds a row): y's columns n0 .. n0 + nb - 1, chunk by chunk of KC columns
// up to PAD(K) (K itself outside the int16 build, whose int8 grid alone has other K), then the
// bias. pb, ps: the thread's panel and its side values.
static void panel_rows(const panel_t *xp, int64_t ldp, const float *xs, int64_t lds, int64_t M,
                       int64_t K, const Src *src, const float *bias, int64_t n0, int64_t nb,
                       float *y, int64_t ldy, panel_t *pb, float *ps)
{
    static __thread uint8_t blocks[16 * KC / QK * 144];  // interleaved rows' blocks back
    const int64_t nbp = (nb + TN - 1) / TN * TN, Kp = PAD(K);
    const int mode = runs16(src->fmt & 0xff) ? Q6 : src->fmt == GRID ? PLAIN : MIN;
    for (int64_t k0 = 0; k0 < Kp; k0 += KC) {
        const int64_t kc = Kp - k0 < KC ? Kp - k0 : KC, pside = kc / QK * SIDE;
        const int64_t kn = K - k0 < kc ? K - k0 : kc;  // columns before the padding
        int64_t have = -1;  // the group of interleaved rows in `blocks` (this chunk's)
        for (int64_t r = 0; r < nb; r++) {
#if defined(KG_I16)
            if (src->fmt == GRID) {
                grid_row(src, K, n0 + r, k0, kc, pb + r * kc, ps + r * pside);
                continue;
            }
#endif
            if (src->fmt & LOOM_KQ_R16) {  // interleaved Q4_K: its group's blocks back first
                const int64_t g = (n0 + r) / 16;
                if (g != have) {
                    loom_kq_r16_group(src->w, K, g, k0 / QK, (k0 + kc) / QK, blocks);
                    have = g;
                }
                panel_row(blocks, Q4_K, kc, (n0 + r) % 16, 0, kc, pb + r * kc, ps + r * pside);
                // a 16th of the next group's blocks a row, so the next unpacking reads cache
                const int64_t span = kc / QK * LOOM_KQ_R16_BYTES, part = span / 16;
                const uint8_t *next = src->w + ((g + 1) * (K / QK) + k0 / QK) * LOOM_KQ_R16_BYTES +
                                      (n0 + r) % 16 * part;
                if (g + 1 < (n0 + nb + 15) / 16)
                    for (int64_t i = 0; i < part; i += 64) __builtin_prefetch(next + i);
                continue;
            }
            panel_row(src->w, src->fmt, K, n0 + r, k0, kc, pb + r * kc, ps + r * pside);
        }
        memset(pb + nb * kc, 0, (size_t)((nbp - nb) * kc) * sizeof(panel_t));
        memset(ps + nb * pside, 0, (size_t)((nbp - nb) * pside) * sizeof(float));
        for (int64_t m = 0; m < M; m += TM) {
            const int mr = M - m < TM ? (int)(M - m) : TM;
            const panel_t *xr = xp + m * ldp + k0;
            const float *xsr = xs + m * lds + k0 / QK * SIDE;
            for (int64_t r = 0; r < nbp; r += TN) {
                float t[TM * TN];
                const panel_t *pr = pb + r * kc;
                const float *psr = ps + r * pside;
#if TM == 4
#define TILES(MODE)                                                          \
    switch (mr) { /* R and the mode constants in each */                     \
    case 1: tile(xr, ldp, xsr, lds, 1, pr, psr, kc, kn, MODE, t); break;     \
    case 2: tile(xr, ldp, xsr, lds, 2, pr, psr, kc, kn, MODE, t); break;     \
    case 3: tile(xr, ldp, xsr, lds, 3, pr, psr, kc, kn, MODE, t); break;     \
    default: tile(xr, ldp, xsr, lds, 4, pr, psr, kc, kn, MODE, t); break;    \
    }
#else
#define TILES(MODE) tile(xr, ldp, xsr, lds, 1, pr, psr, kc, kn, MODE, t);
#endif
                if (mode == Q6) {
                    TILES(Q6)
                } else if (mode == PLAIN) {
                    TILES(PLAIN)
                } else {
                    TILES(MIN)
                }
#undef TILES
                const int64_t cols = nb - r < TN ? nb - r : TN;
                for (int64_t i = 0; i < mr; i++)
                    for (int64_t j = 0; j < cols; j++) {
                        float *o = y + (m + i) * ldy + n0 + r + j;
                        *o = k0 ? *o + t[TN * i + j] : t[TN * i + j];
                    }
            }
        }
    }
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < nb; j++) y[m * ldy + n0 + j] += bias[n0 + j];
}

// A thread's panel buffer for loom_linear_kq_gemm_team (panels hold at most KC columns, so any
// K): 0, or -2 if it cannot be allocated. Every thread of a team calls it before the team form.
int loom_linear_kq_gemm_reserve(void)
{
    // blocking's rows are at most `most` rounded up to TN, and a panel pads them by TN
    return loom_scratch(1, PANEL_BYTES + (size_t)(2 * TN * ROW_BYTES(KC))) ? 0 : -2;
}

// Bytes of x [M, K] as the tiles read it (0: x itself): bf16 [M, K] in the bf16 build; int16
// [M, PAD(K)] and then each row's side values [M, PAD(K) / 256, SIDE] in the int16 build.
int64_t loom_kq_gemm_x_bytes(int64_t M, int64_t K)
{
#if defined(KG_BF16)
    return M * ROW_BYTES(K);
#elif defined(KG_I16)
    return M * ROW_BYTES(PAD(K));
#else
    (void)M, (void)K;
    return 0;
#endif
}

// Thread `tid` of a team of `team`'s share of x's M rows into xp as the tiles read it (where
// loom_kq_gemm_x_bytes is not 0): every thread calls it, then a barrier, before the team form.
static void x_team(const float *x, int64_t M, int64_t K, int64_t ldx, void *xp, int tid,
                   int team, float xmax)
{
    const int64_t m0 = M * tid / team, m1 = M * (tid + 1) / team;
#if defined(KG_BF16)
    (void)m0, (void)m1, (void)xmax;
    loom_bf16_rows_team(x, M, K, ldx, xp, tid, team);
#elif defined(KG_I16)
    const int64_t Kp = PAD(K);
    int16_t *X = xp;
    float *side = (float *)(X + M * Kp);
    for (int64_t m = m0; m < m1; m++)
        x16_row(x + m * ldx, K, xmax, X + m * Kp, side + m * (Kp / QK) * SIDE);
#else
    (void)x, (void)K, (void)ldx, (void)xp, (void)m0, (void)m1, (void)xmax;
#endif
}

void loom_kq_gemm_x_team(const float *x, int64_t M, int64_t K, int64_t ldx, void *xp, int tid,
                         int team)
{
    x_team(x, M, K, ldx, xp, tid, team, 32767.0f);
}

// The (x chunk, panel block) units of a call on src for a thread of a running team (see
// loom_linear_kq_gemm_team).
static void units(const void *xp, int64_t ldp, int64_t M, int64_t K, const Src *src,
                  const float *bias, int64_t N, float *y, int64_t ldy, int64_t *next, int team)
{
    const int64_t Kp = PAD(K), kc = Kp < KC ? Kp : KC;
    int64_t nb_rows;
    const int64_t blocks = loom_weight_blocks(N, PANEL_BYTES / ROW_BYTES(kc), TN, team, &nb_rows);
    // past m_chunk rows, passes of m_chunk rows over all panels (each unpacked once a pass):
    // x's chunk stays in cache while the panels stream past it
    int64_t m_chunk = X_BYTES / (int64_t)sizeof(panel_t) / kc / TM * TM;
    m_chunk = m_chunk < 16 ? 16 : m_chunk;
    const int64_t count = (M + m_chunk - 1) / m_chunk * blocks;
    panel_t *pb = loom_scratch(1, (size_t)((nb_rows + TN) * ROW_BYTES(kc)));  // reserved
    float *ps = (float *)(pb + (nb_rows + TN) * kc);
    const panel_t *xv = xp;
    // the int16 build's side values (the others have none: xs is then never read)
    const float *xs = SIDE ? (const float *)(xv + M * ldp) : (const float *)xp;
    const int64_t lds = Kp / QK * SIDE;
    for (int64_t u; (u = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < count;) {
        const int64_t m0 = u / blocks * m_chunk, mc = M - m0 < m_chunk ? M - m0 : m_chunk;
        const int64_t n0 = u % blocks * nb_rows, nb = N - n0 < nb_rows ? N - n0 : nb_rows;
        panel_rows(xv + m0 * ldp, ldp, xs + m0 * lds, lds, mc, K, src, bias, n0, nb,
                   y + m0 * ldy, ldy, pb, ps);
    }
}

// loom_linear_kq_gemm past 8 rows (K and fmt as loom_kq_check takes: the caller checks) for a
// thread of an OpenMP team that is already running (decoder_q8.c's one region a step): every
// thread calls it with the same arguments and `next` zeroed, after loom_linear_kq_gemm_reserve
// succeeded in it, and takes (x chunk, panel block) units from *next; the caller's barrier ends
// the op. xp: what loom_kq_gemm_x_team wrote (ldp = K) where loom_kq_gemm_x_bytes is not 0,
// else x itself (rows ldp values apart). The same bits as loom_linear_kq_gemm, which is this in
// a region of its own.
void loom_linear_kq_gemm_team(const void *xp, int64_t ldp, int64_t M, int64_t K,
                              const uint8_t *w, int fmt, const float *bias, int64_t N, float *y,
                              int64_t ldy, int64_t *next, int team)
{
    const Src src = {w, fmt, NULL, NULL, 0};
    units(xp, ldp, M, K, &src, bias, N, y, ldy, next, team);
}

// A call past 8 rows in a region of its own: x prepared once (shared), then the units.
static int gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const Src *src,
                const float *bias, int64_t N, float *y, int64_t ldy, int num_threads)
{
    // x as the tiles read it, shared by the team (loom_scratch's slots as linear_bf16.c's: 0 the
    // calling thread's x, 1 each thread's panel)
    const int64_t xb = loom_kq_gemm_x_bytes(M, K);
    void *xp = xb ? loom_scratch(0, (size_t)xb) : (void *)x;
    if (!xp) return -2;
    const int64_t ldp = xb ? PAD(K) : ldx;
    int64_t next = 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int team = omp_get_num_threads();
        if (xb)
            x_team(x, M, K, ldx, xp, omp_get_thread_num(), team,
                   src->fmt == GRID ? GRID_X : 32767.0f);
        if (loom_linear_kq_gemm_reserve()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int skip;
#pragma omp atomic read
        skip = failed;
        if (!skip) units(xp, ldp, M, K, src, bias, N, y, ldy, &next, team);
    }
    return failed ? -2 : 0;
}

// As loom_linear_kq (same arguments, which it runs for up to 8 rows): past 8 rows, panels of
// unpacked weight rows against all rows of x (see the top). Returns 0; -1 on bad K or fmt
// (LOOM_KQ_ONE_DIGIT too: the panels take x their own way, at any M); -2 when a buffer cannot
// be allocated.
int loom_linear_kq_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        int fmt, const float *bias, int64_t N, float *y, int64_t ldy,
                        int num_threads)
{
    if (loom_kq_check(K, fmt)) return -1;
    if (loom_kq_int_rows(fmt, M))
        return loom_linear_kq(x, M, K, ldx, w, fmt, bias, N, y, ldy, num_threads);
    const Src src = {w, fmt, NULL, NULL, 0};
    return gemm(x, M, K, ldx, &src, bias, N, y, ldy, num_threads);
}

// The int8 grid's linear (loom_linear_q8_f32's arguments and returns; it runs up to 8 rows)
// past 8 rows on the int16 tiles: each super-block of a weight row
// rounded to 13-bit integers once a call (grid_row), x to one int16 a super-block. -3 in builds
// without the int16 tiles. A row's bits do not depend on the other rows of its call (they differ
// from the fp32 kernel's).
int loom_linear_q8_i16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads)
{
#if defined(KG_I16)
    if (loom_linear_q8_check(K, bits)) return -1;
    // (at every M past 8, though the fp32 kernel is the faster at a few dozen rows of narrow K,
    // docs/cpu_kernels.md: a request's bits must not depend on how many rows its step had past
    // 8, which a prefix-cache hit changes)
    if (M <= ROWS_INT)
        return loom_linear_q8_f32(x, M, K, ldx, w, scales, mins, bias, N, y, ldy, bits,
                                  num_threads);
    const Src src = {w, GRID, scales, mins, bits};
    return gemm(x, M, K, ldx, &src, bias, N, y, ldy, num_threads);
#else
    (void)x, (void)M, (void)K, (void)ldx, (void)w, (void)scales, (void)mins, (void)bias;
    (void)N, (void)y, (void)ldy, (void)bits, (void)num_threads;
    return -3;
#endif
}

// 1 if this build has loom_linear_q8_i16's tiles, 0 if not.
int loom_i16_available(void)
{
#if defined(KG_I16)
    return 1;
#else
    return 0;
#endif
}
