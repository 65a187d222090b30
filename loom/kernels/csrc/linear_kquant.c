// Linear layers on GGUF's K-quant blocks as the file stores them: y[M, N] = x[M, K] W^T + bias,
// W's rows in Q2_K, Q3_K, Q4_K, Q5_K or Q6_K super-blocks of 256 weights (formats named by ggml's
// type ids: 10 to 14). Bit layouts (checked against the `gguf` package's numpy dequantizer):
//   Q2_K (84 bytes): 16 bytes of 4-bit scales (low nibbles) and minimums (high) a run of 16,
//     64 bytes of 2-bit values laid out as Q6_K's qh (byte 32c + l holds weights 128c + 32t + l
//     in its bits 2t, 2t + 1), fp16 d, fp16 dmin; w = d sc[i / 16] q - dmin m[i / 16]: Q6_K's
//     runs with a minimum a run in place of the -32.
//   Q3_K (110 bytes): 32 bytes of third bits (bit 4c + t of byte l: weight 128c + 32t + l's), 64
//     of 2-bit values as Q2_K's, 12 bytes of 6-bit scales s + 32 (q3_scale_bytes), fp16 d;
//     w = d s[i / 16] (q - 4), q = the two bits + 4 x the third: Q6_K's runs with -4.
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and minimums m[8],
//     128 bytes of nibbles: bytes 32j .. 32j + 31 hold weights 64j + l in their low nibbles and
//     64j + 32 + l in their high ones; w = d sc[i / 32] q - dmin m[i / 32].
//   Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits between scales and nibbles: bit t of
//     byte l is weight 32t + l's (16 added to its nibble).
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d;
//     per half c of 128: ql bytes 64c + l (l < 64) hold weight 128c + l low and 128c + 64 + l
//     high; qh byte 32c + l holds bits 4-5 of weights 128c + 32t + l in its bits 2t, 2t + 1;
//     w = d sc[i / 16] (q - 32).
//
// Decode (the memory-bound case): x is quantized once a call, each run of 16 values with d =
// max |x| / 127 and two int8 digits, x / d = a + b / 256 (to 1/512 of d, 1/256 where b
// saturates); a run's sum of q x is d (256 sum q a + sum q b) / 256 in exact int32 (q unsigned,
// the digits signed: vpdpbusd's operands as they are; AVX2 takes X = 256 a + b as one int16 into
// vpmaddwd, the same integers), scaled by the run's weight
// scale (d sc) and the run's d / 256 in fp32; the minimums' (Q4_K, Q5_K: x~ summed over each
// block of 32; Q2_K: over each run) and the -32's (Q6_K) and -4's (Q3_K: over each run) terms
// take one fma a super-block. x's layout
// (quantize_row) is the kernel's own per build and format, so the blocks are read as stored
// with few shuffles. One digit (llama.cpp's; a format or'ed with LOOM_KQ_ONE_DIGIT) falls below
// the accuracy bar on every projection of Gemma 3 270M, two do not (docs/kquants.md).
// Every output is summed in the same order whatever M (up to 8 rows at once, more in chunks of
// 8 over blocks of weight rows), so a row's bits do not depend on its batch within a build.
//
// Built without fast math (loom/kernels/build.py).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kquant_blocks.h"  // QK, the formats, f16_at, the scales
#include "loom.h"

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define KQ_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define KQ_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)  // with dot products or without (neon_dot.h)
#define KQ_NEON 1
#include "neon_dot.h"
#endif

#define RUN 16        // x values a scale (and the finest weight sub-block: Q6_K's)
#define M_MAX 8       // x rows at once
#if defined(KQ_AVX512)  // x rows against a weight row (rows_kq): up to 6 in one tile, then tiles
#define KQ_ONE_TILE 6     // of at most 4
#define KQ_TILE 4
#else
#define KQ_ONE_TILE M_MAX
#define KQ_TILE M_MAX
#endif
#define KQ_BLOCK 8    // weight rows a block (rows_kq)
#define NB_ROWS 16    // weight rows a unit of work
#define PF 4096       // weight bytes prefetched ahead in a row (0.91x a 1 GB stream against 1 KiB)
// and, in rows of FAR_ROW bytes or more, PF_FAR ahead into L2 (prefetcht1, as linear_vnni.c):
// 8 layers of the 1.7B shape from memory, one row on two threads, 0.85-0.87x the time (AVX-512
// build, Zen 4).
#define PF_FAR 8192
#define FAR_ROW 1024

// A super-block's bytes (bb at blk) prefetched PF ahead, and PF_FAR into L2 in a row that is far.
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *blk, int bb,
                                                                 int far)
{
    for (int i = 0; i < bb; i += 64) {
        __builtin_prefetch(blk + PF + i);
        if (far) __builtin_prefetch(blk + PF_FAR + i, 0, 2);
    }
}

// Bytes of one super-block of `fmt`; 0 for a format this file does not run.
int loom_kq_block_bytes(int fmt)
{
    return fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : fmt == Q6_K ? 210 : fmt == Q3_K ? 110
           : fmt == Q2_K ? 84 : 0;
}

// Which SIMD code this build runs the K-quant kernels with: 4 AVX512-VNNI, 3 AVX-512 (BW),
// 2 AVX2, 1 NEON (sdot or its widening-multiply form), 0 portable C.
int loom_kq_isa(void)
{
#if defined(KQ_AVX512) && defined(__AVX512VNNI__)
    return 4;
#elif defined(KQ_AVX512)
    return 3;
#elif defined(KQ_AVX2)
    return 2;
#elif defined(KQ_NEON)
    return 1;
#else
    return 0;
#endif
}

// 0 if the kernels take rows of K weights in `fmt` (a format alone: LOOM_KQ_ONE_DIGIT is
// loom_linear_kq's, which checks the format without it); -1 if not.
int loom_kq_check(int64_t K, int fmt)
{
    if (fmt & LOOM_KQ_R16) {  // Q4_K alone, in builds with its kernel (loom_kq_r16_available)
        if (fmt != (Q4_K | LOOM_KQ_R16) || !loom_kq_r16_available()) return -1;
        fmt = Q4_K;
    }
    return K <= 0 || K % QK != 0 || !loom_kq_block_bytes(fmt) ? -1 : 0;
}

// ---- Q4_K rows interleaved 16 at a time (LOOM_KQ_R16) ----------------------------------------
// The same bytes as 16 rows' Q4_K blocks, rearranged: for each super-block s, 2304 bytes (16 x
// 144) at the group's offset (rows 16g .. 16g + 15 keep their place in the tensor):
//   [0, 32) the 16 rows' fp16 d, [32, 64) their fp16 dmin, [64, 256) the scale bytes: byte t
//   (0..11) of row r at 64 + 16 t + r, [256, 2304) the nibbles in 32 chunks of 8 weights:
//   byte 4 r + i of chunk c holds row r's weight 8c + i (low nibble) and 8c + 4 + i (high).
// So a 64-byte load gives 16 rows x 8 weights, each 32-bit lane one row's (x's four values
// broadcast to every lane), and a sub-block's scale and minimum are one vector for 16 rows.

int loom_kq_r16_available(void)
{
#if defined(KQ_AVX512) && defined(__AVX512VNNI__)  // (KQ_R16, below)
    return 1;
#else
    return 0;
#endif
}

static inline void block_values(const uint8_t *blk, int fmt, uint8_t q[QK]);  // below

#if defined(KQ_AVX512)
// One super-block of 16 rows (row r's block at blk + r * stride) into its interleaved 2304
// bytes at o: loom_kq_r16_group's transposes run backwards (the same layout; ~3x the scalar
// loop's speed, which made an 8B model's load 2-3 s longer).
static void pack_group_sb(const uint8_t *blk, int64_t stride, uint8_t *o)
{
    {  // headers: rows r and r + 8 in the two lanes of R[r], 8 words each, transposed 8 x 8
        __m256i R[8], a[8], c[8];
        for (int r = 0; r < 8; r++)
            R[r] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(blk + (r + 8) * stride)),
                                    _mm_loadu_si128((const __m128i *)(blk + r * stride)));
        for (int k = 0; k < 4; k++) {
            a[2 * k] = _mm256_unpacklo_epi16(R[2 * k], R[2 * k + 1]);
            a[2 * k + 1] = _mm256_unpackhi_epi16(R[2 * k], R[2 * k + 1]);
        }
        for (int k = 0; k < 2; k++)
            for (int h = 0; h < 2; h++) {
                c[4 * k + 2 * h] = _mm256_unpacklo_epi32(a[4 * k + h], a[4 * k + 2 + h]);
                c[4 * k + 2 * h + 1] = _mm256_unpackhi_epi32(a[4 * k + h], a[4 * k + 2 + h]);
            }
        // word w of the 16 rows (rows 0-7 low lane, 8-15 high) as in loom_kq_r16_group
        const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11,
                                                  13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5,
                                                  7, 9, 11, 13, 15);
        for (int i = 0; i < 4; i++)
            for (int e = 0; e < 2; e++) {
                const __m256i W = e ? _mm256_unpackhi_epi64(c[i], c[4 + i])
                                    : _mm256_unpacklo_epi64(c[i], c[4 + i]);
                const int word = 2 * i + e;
                if (word < 2) {  // d, dmin: 16 fp16 as they are
                    _mm256_storeu_si256((__m256i *)(o + 32 * word), W);
                    continue;
                }
                // scale bytes 2 (word - 2) and the next: the even and the odd bytes
                const __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(W, even_odd),
                                                           0xD8);
                _mm_storeu_si128((__m128i *)(o + 64 + 32 * (word - 2)),
                                 _mm256_castsi256_si128(b));
                _mm_storeu_si128((__m128i *)(o + 80 + 32 * (word - 2)),
                                 _mm256_extracti128_si256(b, 1));
            }
    }
    const __m512i nib = _mm512_set1_epi8(15);
    for (int J = 0; J < 4; J++) {
        __m512i Tq[4][2];  // [v][e]: lane L row 4L + v's four chunks of sub-block 2J + e
        for (int v = 0; v < 4; v++) {
            __m512i X[2];  // lane L: row 4L + v's bytes 16h .. 16h + 15 of segment J
            for (int h = 0; h < 2; h++) {
                const uint8_t *at = blk + v * stride + 16 + 32 * J + 16 * h;
                X[h] = _mm512_inserti32x4(
                    _mm512_inserti32x4(
                        _mm512_inserti32x4(_mm512_castsi128_si512(
                                               _mm_loadu_si128((const __m128i *)at)),
                                           _mm_loadu_si128((const __m128i *)(at + 4 * stride)), 1),
                        _mm_loadu_si128((const __m128i *)(at + 8 * stride)), 2),
                    _mm_loadu_si128((const __m128i *)(at + 12 * stride)), 3);
            }
            for (int e = 0; e < 2; e++) {  // sub-block 2J + e: low nibbles, then high
                const __m512i V0 = e ? _mm512_and_si512(_mm512_srli_epi16(X[0], 4), nib)
                                     : _mm512_and_si512(X[0], nib);
                const __m512i V1 = e ? _mm512_and_si512(_mm512_srli_epi16(X[1], 4), nib)
                                     : _mm512_and_si512(X[1], nib);
                const __m512i L = _mm512_castps_si512(_mm512_shuffle_ps(
                    _mm512_castsi512_ps(V0), _mm512_castsi512_ps(V1), 0x88));  // dwords 0, 2
                const __m512i H = _mm512_castps_si512(_mm512_shuffle_ps(
                    _mm512_castsi512_ps(V0), _mm512_castsi512_ps(V1), 0xDD));  // dwords 1, 3
                Tq[v][e] = _mm512_or_si512(L, _mm512_slli_epi16(H, 4));
            }
        }
        for (int e = 0; e < 2; e++) {  // the 4 x 4 transpose is its own inverse
                const __m512i t0 = _mm512_unpacklo_epi32(Tq[0][e], Tq[1][e]),
                              t1 = _mm512_unpackhi_epi32(Tq[0][e], Tq[1][e]),
                              t2 = _mm512_unpacklo_epi32(Tq[2][e], Tq[3][e]),
                              t3 = _mm512_unpackhi_epi32(Tq[2][e], Tq[3][e]);
                uint8_t *q = o + 256 + 256 * (2 * J + e);
                _mm512_storeu_si512(q, _mm512_unpacklo_epi64(t0, t2));
                _mm512_storeu_si512(q + 64, _mm512_unpackhi_epi64(t0, t2));
                _mm512_storeu_si512(q + 128, _mm512_unpacklo_epi64(t1, t3));
                _mm512_storeu_si512(q + 192, _mm512_unpackhi_epi64(t1, t3));
        }
    }
}
#endif

// Rows [16 g0, 16 g1) of Q4_K rows w (K a row) interleaved at out (the same offsets).
void loom_kq_r16_pack(const uint8_t *w, int64_t K, int64_t g0, int64_t g1, uint8_t *out,
                      int num_threads)
{
    const int64_t nsb = K / QK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = g0; g < g1; g++)
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t *o = out + (g * nsb + s) * LOOM_KQ_R16_BYTES;
#if defined(KQ_AVX512)
            pack_group_sb(w + (g * 16 * nsb + s) * 144, nsb * 144, o);
#else  // portable (no build without AVX-512 runs the interleaved kernel yet)
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = w + ((g * 16 + r) * nsb + s) * 144;
                uint8_t q[QK];
                memcpy(o + 2 * r, blk, 2);
                memcpy(o + 32 + 2 * r, blk + 2, 2);
                for (int t = 0; t < 12; t++) o[64 + 16 * t + r] = blk[4 + t];
                block_values(blk, Q4_K, q);
                for (int c = 0; c < 32; c++)
                    for (int i = 0; i < 4; i++)
                        o[256 + 64 * c + 4 * r + i] =
                            (uint8_t)(q[8 * c + i] | q[8 * c + 4 + i] << 4);
            }
#endif
        }
}

// Super-blocks [s0, s1) of the 16 rows of group g of interleaved rows w as the Q4_K blocks they
// came from: row r's at out + (r * (s1 - s0) + s - s0) * 144 (16 rows of s1 - s0 blocks). The
// GEMM past 8 rows unpacks its panels from these (loom_kq_r16_row a row at a time, but ~10x the
// time: +15% on a 128-row product).
void loom_kq_r16_group(const uint8_t *w, int64_t K, int64_t g, int64_t s0, int64_t s1,
                       uint8_t *out)
{
    const int64_t nsb = K / QK, ns = s1 - s0;
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *o = w + (g * nsb + s) * LOOM_KQ_R16_BYTES;
        for (int c = 0; c < 256; c += 64) __builtin_prefetch(o + PF + c);
#if defined(KQ_AVX512)
        {  // each row's first 16 bytes: 8 words (d, dmin, scale bytes in pairs) of 16 rows,
           // transposed 8 x 8 in each 128-bit lane (rows 0-7 low, 8-15 high)
            __m256i W[8], a[8], c[8];
            W[0] = _mm256_loadu_si256((const __m256i *)o);
            W[1] = _mm256_loadu_si256((const __m256i *)(o + 32));
            for (int k = 0; k < 6; k++) {
                const __m128i s0 = _mm_loadu_si128((const __m128i *)(o + 64 + 32 * k)),
                              s1 = _mm_loadu_si128((const __m128i *)(o + 80 + 32 * k));
                W[2 + k] = _mm256_set_m128i(_mm_unpackhi_epi8(s0, s1), _mm_unpacklo_epi8(s0, s1));
            }
            for (int k = 0; k < 4; k++) {
                a[2 * k] = _mm256_unpacklo_epi16(W[2 * k], W[2 * k + 1]);      // rows 0-3
                a[2 * k + 1] = _mm256_unpackhi_epi16(W[2 * k], W[2 * k + 1]);  // rows 4-7
            }
            for (int k = 0; k < 2; k++)
                for (int h = 0; h < 2; h++) {  // words 4k .. 4k + 3 of rows 4h + 0/1, 2/3
                    c[4 * k + 2 * h] = _mm256_unpacklo_epi32(a[4 * k + h], a[4 * k + 2 + h]);
                    c[4 * k + 2 * h + 1] = _mm256_unpackhi_epi32(a[4 * k + h], a[4 * k + 2 + h]);
                }
            for (int i = 0; i < 4; i++)  // c[i]: words 0-3 of rows 2i', c[4 + i] words 4-7
                for (int e = 0; e < 2; e++) {
                    const __m256i row = e ? _mm256_unpackhi_epi64(c[i], c[4 + i])
                                          : _mm256_unpacklo_epi64(c[i], c[4 + i]);
                    const int r = 2 * i + e;  // and r + 8 in the high lane
                    _mm_storeu_si128((__m128i *)(out + (r * ns + s - s0) * 144),
                                     _mm256_castsi256_si128(row));
                    _mm_storeu_si128((__m128i *)(out + ((r + 8) * ns + s - s0) * 144),
                                     _mm256_extracti128_si256(row, 1));
                }
        }
        // each sub-block j: its 4 chunks transposed in 128-bit lanes (lane L of T[v] is row
        // 4L + v's 16 bytes), the nibbles apart and back in weight order (V: values 0..15,
        // 16..31 of the sub-block), sub-block 2J + 1's then the high nibbles of 2J's bytes
        const __m512i nib = _mm512_set1_epi8(15);
        for (int J = 0; J < 4; J++) {
            __m512i V[2][4][2];  // [sub-block of the pair][v][half]
            for (int e = 0; e < 2; e++) {
                const uint8_t *q = o + 256 + 256 * (2 * J + e);
                for (int c = 0; c < 256; c += 64) __builtin_prefetch(q + PF + c);
                const __m512i C0 = _mm512_loadu_si512(q), C1 = _mm512_loadu_si512(q + 64),
                              C2 = _mm512_loadu_si512(q + 128), C3 = _mm512_loadu_si512(q + 192);
                const __m512i t0 = _mm512_unpacklo_epi32(C0, C1),
                              t1 = _mm512_unpackhi_epi32(C0, C1),
                              t2 = _mm512_unpacklo_epi32(C2, C3),
                              t3 = _mm512_unpackhi_epi32(C2, C3);
                const __m512i T[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                                      _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
                for (int v = 0; v < 4; v++) {
                    const __m512i L = _mm512_and_si512(T[v], nib);
                    const __m512i H = _mm512_and_si512(_mm512_srli_epi16(T[v], 4), nib);
                    V[e][v][0] = _mm512_unpacklo_epi32(L, H);
                    V[e][v][1] = _mm512_unpackhi_epi32(L, H);
                }
            }
            for (int v = 0; v < 4; v++)
                for (int h = 0; h < 2; h++) {
                    const __m512i b = _mm512_or_si512(V[0][v][h],
                                                      _mm512_slli_epi16(V[1][v][h], 4));
                    uint8_t *at = out + (v * ns + s - s0) * 144 + 16 + 32 * J + 16 * h;
                    const int64_t lane = 4 * ns * 144;  // rows 4 apart
                    _mm_storeu_si128((__m128i *)at, _mm512_castsi512_si128(b));
                    _mm_storeu_si128((__m128i *)(at + lane), _mm512_extracti32x4_epi32(b, 1));
                    _mm_storeu_si128((__m128i *)(at + 2 * lane), _mm512_extracti32x4_epi32(b, 2));
                    _mm_storeu_si128((__m128i *)(at + 3 * lane), _mm512_extracti32x4_epi32(b, 3));
                }
        }
#else
        for (int r = 0; r < 16; r++)
            loom_kq_r16_row(w, K, g * 16 + r, s, s + 1, out + (r * ns + s - s0) * 144);
#endif
    }
}

// Super-blocks [s0, s1) of row n of interleaved rows w as the Q4_K blocks they came from.
void loom_kq_r16_row(const uint8_t *w, int64_t K, int64_t n, int64_t s0, int64_t s1,
                     uint8_t *blocks)
{
    const int64_t nsb = K / QK, r = n % 16;
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *o = w + ((n / 16) * nsb + s) * LOOM_KQ_R16_BYTES;
        uint8_t *blk = blocks + (s - s0) * 144, q[QK];
        memcpy(blk, o + 2 * r, 2);
        memcpy(blk + 2, o + 32 + 2 * r, 2);
        for (int t = 0; t < 12; t++) blk[4 + t] = o[64 + 16 * t + r];
        for (int c = 0; c < 32; c++)
            for (int i = 0; i < 4; i++) {
                const uint8_t v = o[256 + 64 * c + 4 * r + i];
                q[8 * c + i] = v & 15;
                q[8 * c + 4 + i] = v >> 4;
            }
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                blk[16 + 32 * j + l] = (uint8_t)(q[64 * j + l] | q[64 * j + 32 + l] << 4);
    }
}

// ---- the blocks' integers (their scales: kquant_blocks.h) --------------------------------

// A super-block's 256 unsigned integers in weight order (portable).
static inline void block_values(const uint8_t *blk, int fmt, uint8_t q[QK])
{
    if (fmt == Q2_K || fmt == Q3_K) {
        const uint8_t *qs = blk + (fmt == Q2_K ? 16 : 32);
        for (int c = 0; c < 2; c++)
            for (int t = 0; t < 4; t++)
                for (int l = 0; l < 32; l++) {
                    uint8_t v = (uint8_t)((qs[32 * c + l] >> (2 * t)) & 3);
                    if (fmt == Q3_K) v |= (uint8_t)(((blk[l] >> (4 * c + t)) & 1) << 2);
                    q[128 * c + 32 * t + l] = v;
                }
        return;
    }
    if (fmt == Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        for (int c = 0; c < 2; c++)
            for (int l = 0; l < 64; l++) {
                const int t = l / 32, j = l % 32;
                const uint8_t hb = qh[32 * c + j];
                q[128 * c + l] = (uint8_t)((ql[64 * c + l] & 15) | ((hb >> (2 * t)) & 3) << 4);
                q[128 * c + 64 + l] =
                    (uint8_t)((ql[64 * c + l] >> 4) | ((hb >> (2 * t + 4)) & 3) << 4);
            }
        return;
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16), *qh = blk + 16;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            q[64 * j + l] = qs[32 * j + l] & 15;
            q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
            if (fmt == Q5_K) {
                q[64 * j + l] |= (uint8_t)(((qh[l] >> (2 * j)) & 1) << 4);
                q[64 * j + 32 + l] |= (uint8_t)(((qh[l] >> (2 * j + 1)) & 1) << 4);
            }
        }
}

// Rows [n0, n1) of w (K a row, `fmt`) as fp32, out[(n - n0) * ldo + k]: sw * q - ow, the
// `gguf` package's values bit for bit (every product is exact in fp32; one rounding).
void loom_kq_dequant(const uint8_t *w, int fmt, int64_t K, int64_t n0, int64_t n1, float *out,
                     int64_t ldo)
{
    const int r16 = fmt & LOOM_KQ_R16;
    fmt &= 0xff;
    const int bb = loom_kq_block_bytes(fmt);
    const int64_t nsb = K / QK;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t one[144];
            if (r16) loom_kq_r16_row(w, K, n, s, s + 1, one);
            const uint8_t *blk = r16 ? one : w + (n * nsb + s) * bb;
            float sw[16], ow[16];
            uint8_t q[QK];
            block_scales(blk, fmt, sw, ow);
            block_values(blk, fmt, q);
            float *o = out + (n - n0) * ldo + s * QK;
            for (int i = 0; i < QK; i++) o[i] = sw[i / RUN] * (float)q[i] - ow[i / RUN];
        }
}

// ---- quantized x ---------------------------------------------------------------------------
// One row of K: int8 a[K], int8 b[K] (the digits, in the kernel's order of runs: run_of), then
// fp32 dr[K / 16] (each run's d / 256, a super-block's 16 in dr_slot order) and fp32 sm[K / 16],
// a super-block's terms of the offsets: the runs of 16 formats (runs16) sx[h] for each run h
// (sx: a run's sum of x~ = d (a + b / 256)), in dr_slot order; Q4_K / Q5_K sx over each
// sub-block j of 32, at 2j + 1 with AVX-512 (0 between), else at 8 + j (0 before).
// stride: bytes a row (a multiple of 64).
static inline int64_t x_stride(int64_t K) { return 2 * K + K / RUN * 8; }

#if !defined(KQ_AVX2)  // (the AVX2 build: quantize_block16 below, runs in natural order)
// The natural run the kernel's run r of a super-block holds. AVX-512, Q4_K / Q5_K: a 64-byte
// load's low nibbles are weights 128c + 0..31 and 128c + 64..95, its high ones 128c + 32..63 and
// 128c + 96..127, so x's blocks of 32 go in the order 0 2 1 3 4 6 5 7 (no shuffles of weights).
static inline int run_of(int fmt, int r)
{
#if defined(KQ_AVX512)
    const int j = r / 2;
    return runs16(fmt) ? r : 2 * ((j & 4) | (j & 1) << 1 | (j >> 1 & 1)) + (r & 1);
#else
    (void)fmt;
    return r;
#endif
}

// One run's digits from t = x * 127 / max|x| (|t| <= 127): a = t to nearest even, b = (t - a)
// 256 (t - a exact) to nearest even, 128 -> 127. The same values in every build (AVX2:
// quantize_block16, 8 lanes at once). Returns the run's sum of 256 a + b (exact); *dr = d / 256.
// With `one` digit: a alone (b left unwritten), its sum, *dr = d.
static inline int32_t quantize_run(const float *xr, int8_t *a, int8_t *b, float *dr, int one)
{
#if defined(KQ_AVX512)
    const __m512 v = _mm512_loadu_ps(xr);
    const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
    const __m512 t = _mm512_mul_ps(v, _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f));
    const __m512i ai = _mm512_cvtps_epi32(t);
    const __m512i bi = _mm512_cvtps_epi32(
        _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(ai)), _mm512_set1_ps(256.0f)));
    const __m512i bc = _mm512_min_epi32(bi, _mm512_set1_epi32(127));
    _mm_storeu_si128((__m128i *)a, _mm512_cvtepi32_epi8(ai));
    if (one) {
        *dr = amax / 127.0f;
        return _mm512_reduce_add_epi32(ai);
    }
    _mm_storeu_si128((__m128i *)b, _mm512_cvtepi32_epi8(bc));
    const int32_t tot = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(ai, 8), bc));
#else
    float amax = 0.0f;
    for (int i = 0; i < RUN; i++) amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t tot = 0;
    for (int i = 0; i < RUN; i++) {
        const float t = xr[i] * inv, ai = rintf(t);
        float bf = rintf((t - ai) * 256.0f);
        bf = bf > 127.0f ? 127.0f : bf;
        a[i] = (int8_t)ai;
        if (one) {
            tot += (int32_t)ai;
            continue;
        }
        b[i] = (int8_t)bf;
        tot += 256 * (int32_t)ai + (int32_t)bf;
    }
    if (one) {
        *dr = amax / 127.0f;
        return tot;
    }
#endif
    *dr = amax / 127.0f / 256.0f;
    return tot;
}
#endif

// Where run r's d / 256 goes among a super-block's 16: AVX-512 keeps them transposed (slot
// 4 (r % 4) + r / 4), so the scales of vector v's runs 4v .. 4v + 3 are element v of each
// 128-bit lane (an in-lane shuffle, not a permute across lanes).
static inline int dr_slot(int r)
{
#if defined(KQ_AVX512)
    return 4 * (r % 4) + r / 4;
#elif defined(KQ_AVX2)  // the same in each half of 8 (vectors of 32: two runs each)
    return 8 * (r / 8) + 4 * (r % 2) + (r % 8) / 2;
#else
    return r;
#endif
}

#if defined(KQ_AVX2)
// quantize_run's values for a block of 32 (two runs) in 8 lanes, the same bits (t = x * inv,
// a = rint t, b = min(rint((t - a) 256), 127): each step one IEEE operation as there), given
// each run's inv = 127 / max |x| (0 for a zero run) and d / 256 (or d): X = 256 a + b (or a) at
// X[0..15] for the block's even values, X[16..31] its odd ones; each run's sum of X times its
// d at sx[0..1]. With quantize_row's divisions in vectors, 0.17x the scalar loop's time.
static inline void quantize_block16(const float *x, int16_t *X, const float inv[2],
                                    const float d[2], float sx[2], int one)
{
    __m256i q[4];  // values 8 t .. 8 t + 7 as int32
    for (int r = 0; r < 2; r++) {
        __m256i sum = _mm256_setzero_si256();
        for (int u = 0; u < 2; u++) {
            const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + 16 * r + 8 * u),
                                           _mm256_set1_ps(inv[r]));
            const __m256 a = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i w = _mm256_cvtps_epi32(a);
            if (!one) {
                const __m256 b = _mm256_min_ps(
                    _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, a), _mm256_set1_ps(256.0f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                    _mm256_set1_ps(127.0f));
                w = _mm256_add_epi32(_mm256_slli_epi32(w, 8), _mm256_cvtps_epi32(b));
            }
            q[2 * r + u] = w;
            sum = _mm256_add_epi32(sum, w);
        }
        sx[r] = (float)hsum8_epi32(sum) * d[r];
    }
    // even values: each int32 lane's own 16 bits (sign-extended), odd: its upper 16 after the
    // pack; vpackssdw packs within 128-bit lanes, 0xD8 puts the 64-bit quarters back in order
    __m256i e[2], o[2];
    for (int t = 0; t < 2; t++) {
        const __m256i n = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * t], q[2 * t + 1]),
                                                   0xD8);  // values 16 t .. 16 t + 15
        e[t] = _mm256_srai_epi32(_mm256_slli_epi32(n, 16), 16);
        o[t] = _mm256_srai_epi32(n, 16);
    }
    _mm256_storeu_si256((__m256i *)X,
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(e[0], e[1]), 0xD8));
    _mm256_storeu_si256((__m256i *)(X + 16),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(o[0], o[1]), 0xD8));
}
#endif

static void quantize_row(const float *x, int64_t K, int fmt, uint8_t *buf, int one)
{
    float *dr = (float *)(buf + 2 * K), *sm = dr + K / RUN;
#if !defined(KQ_AVX2)
    int8_t *a = (int8_t *)buf, *b = a + K;
#endif
    for (int64_t s = 0; s < K / QK; s++) {
        float sx[16];  // natural order
#if defined(KQ_AVX2)  // X = 256 a + b (or a), each sub-block of 32's even values, then its odd
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        float amax[16], inv[16], d[16];
        for (int r = 0; r < 16; r++) {
            const float *v = x + s * QK + r * RUN;
            amax[r] = hmax8(_mm256_max_ps(_mm256_and_ps(abs, _mm256_loadu_ps(v)),
                                          _mm256_and_ps(abs, _mm256_loadu_ps(v + 8))));
        }
        for (int i = 0; i < 16; i += 8) {  // quantize_run's divisions, 8 at once
            const __m256 m = _mm256_loadu_ps(amax + i), c = _mm256_set1_ps(127.0f);
            _mm256_storeu_ps(inv + i, _mm256_and_ps(_mm256_cmp_ps(m, _mm256_setzero_ps(),
                                                                  _CMP_GT_OQ),
                                                    _mm256_div_ps(c, m)));
            const __m256 dd = _mm256_div_ps(m, c);
            _mm256_storeu_ps(d + i, one ? dd : _mm256_div_ps(dd, _mm256_set1_ps(256.0f)));
        }
        for (int r = 0; r < 16; r++) dr[s * 16 + dr_slot(r)] = d[r];
        for (int j = 0; j < 8; j++)
            quantize_block16(x + s * QK + 32 * j, (int16_t *)buf + s * QK + 32 * j, inv + 2 * j,
                             d + 2 * j, sx + 2 * j, one);
#else
        for (int r = 0; r < 16; r++) {
            const int h = run_of(fmt, r);
            const int64_t at = s * QK + r * RUN;
            float *d = dr + s * 16 + dr_slot(r);
            sx[h] = (float)quantize_run(x + s * QK + h * RUN, a + at, b + at, d, one) * *d;
        }
#endif
        float *o = sm + s * 16;
        for (int h = 0; h < 16; h++) o[h] = 0.0f;
        for (int h = 0; h < 16; h++) {
            if (runs16(fmt)) {
                o[dr_slot(h)] = sx[h];
            } else if (h % 2 == 0) {  // a block of 32's sum: AVX-512 at 2j + 1, else at 8 + j
#if defined(KQ_AVX512)
                o[h + 1] = sx[h] + sx[h + 1];
#else
                o[8 + h / 2] = sx[h] + sx[h + 1];
#endif
            }
        }
    }
}

// ---- one weight row against M quantized x rows ------------------------------------------------
// out[m * ldy] = sum over super-blocks of sum_h sw[h] dr[h] (256 A_h + B_h) - ow[h] sx[h].

#if defined(KQ_AVX512)
// A super-block's integers as four vectors of 64 in x's order (run_of), its weight scales sw in
// that order of runs, and ow, its minimums' terms against x's sm (natural order).
static inline __attribute__((always_inline)) void unpack512(const uint8_t *blk, const int fmt,
                                                            __m512i W[4], __m512 *sw, __m512 *ow)
{
    const __m512i nib = _mm512_set1_epi8(15);
    if (runs16(fmt)) {
        const __m128i order =  // dr_slot order: slot 4q + v, run 4v + q
            _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        if (fmt == Q6_K || fmt == Q3_K) {  // int8 scales (Q3_K's decoded, less 32)
            const __m128i raw = fmt == Q3_K ? q3_scales128(blk)
                                            : _mm_loadu_si128((const __m128i *)(blk + 192));
            *sw = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_shuffle_epi8(raw, order))),
                                _mm512_set1_ps(f16_at(blk + (fmt == Q6_K ? 208 : 108))));
            // the offset a run, against x's sm (sx a run, the same order): Q6_K's 32 sw, Q3_K's 4
            *ow = _mm512_mul_ps(*sw, _mm512_set1_ps(fmt == Q6_K ? 32.0f : 4.0f));
        } else {  // Q2_K: scales in the low nibbles, minimums (its offsets) in the high
            const __m512i sm = _mm512_cvtepu8_epi32(
                _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)blk), order));
            *sw = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(sm, _mm512_set1_epi32(15))),
                                _mm512_set1_ps(f16_at(blk + 80)));
            *ow = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4)),
                                _mm512_set1_ps(f16_at(blk + 82)));
        }
        // bits 4-5 from qh (Q2_K: its values, the same layout): the first 32 bytes of a vector
        // take qh's bits 0-1 (low nibbles) or 4-5 (high), the second 32 bits 2-3 or 6-7;
        // shifts by 16-bit lanes stay within bytes
        const __m512i m_lo = _mm512_inserti64x4(_mm512_set1_epi8(0x03), _mm256_set1_epi8(0x0C), 1);
        const __m512i m_hi = _mm512_inserti64x4(_mm512_set1_epi8(0x30), _mm256_set1_epi8(-64), 1);
        const __m512i c_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        const __m512i c_hi = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        // Q2_K / Q3_K: bits 0-1 or 2-3 (low: c_hi's shifts), 4-5 or 6-7 (high) down to 0-1
        const __m512i v_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
        const uint8_t *qh = blk + (fmt == Q6_K ? 128 : fmt == Q3_K ? 32 : 16);
        // Q3_K's third bits: byte l's bit 4c + t for weight 128c + 32t + l, t per 256-bit half
        const __m512i HM = fmt == Q3_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                             (const __m256i *)blk))
                                       : _mm512_setzero_si512();
        for (int c = 0; c < 2; c++) {
            const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                (const __m256i *)(qh + 32 * c)));
            if (fmt != Q6_K) {  // the values straight down to bits 0-1 (masked: within bytes)
                W[2 * c] = _mm512_srlv_epi16(_mm512_and_si512(H, m_lo), c_hi);
                W[2 * c + 1] = _mm512_srlv_epi16(_mm512_and_si512(H, m_hi), v_hi);
                if (fmt == Q3_K)
                    for (int k = 0; k < 2; k++) {  // t = 2k (first half), 2k + 1 (second)
                        const __m512i bit = _mm512_inserti64x4(
                            _mm512_set1_epi8((char)(1 << (4 * c + 2 * k))),
                            _mm256_set1_epi8((char)(1 << (4 * c + 2 * k + 1))), 1);
                        W[2 * c + k] = _mm512_mask_add_epi8(
                            W[2 * c + k], _mm512_test_epi8_mask(HM, bit), W[2 * c + k],
                            _mm512_set1_epi8(4));
                    }
                continue;
            }
            const __m512i h0 = _mm512_sllv_epi16(_mm512_and_si512(H, m_lo), c_lo);
            const __m512i h1 = _mm512_srlv_epi16(_mm512_and_si512(H, m_hi), c_hi);
            const __m512i L = _mm512_loadu_si512(blk + 64 * c);
            // (nibbles & 15) | the high bits (0xEC: (a & c) | b), which the masks leave alone at
            // bits 4-5
            W[2 * c] = _mm512_ternarylogic_epi32(L, h0, nib, 0xEC);
            W[2 * c + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(L, 4), h1, nib, 0xEC);
        }
        return;
    }
    // the block's first 16 bytes: fp16 d, dmin, then the 12 bytes of scales (k4_scales) at 4..15
    const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
    const __m512 dd = _mm512_castpd_ps(_mm512_broadcastsd_pd(  // d, dmin, d, dmin, ...
        _mm_castps_pd(_mm_cvtph_ps(raw))));
    // x1: sc 0..3, m 0..3 (bytes 4..11, low 6 bits), sc 4..7's low bits (bytes 12..15, low
    // nibbles); x2: sc 4..7's and m 4..7's top bits at 4-5 (bytes 4..11), m 4..7's low bits
    const __m128i x1 = _mm_and_si128(raw, _mm_setr_epi32(0, 0x3f3f3f3f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i x2 = _mm_and_si128(_mm_srlv_epi16(raw, _mm_setr_epi16(0, 0, 2, 2, 2, 2, 4, 4)),
                                     _mm_setr_epi32(0, 0x30303030, 0x30303030, 0x0f0f0f0f));
    const __m128i scm = _mm_ternarylogic_epi32(  // sc[j] at 2j, m[j] at 2j + 1 (a | b | c)
        _mm_shuffle_epi8(x1, _mm_setr_epi8(4, 8, 5, 9, 6, 10, 7, 11,
                                           12, -1, 13, -1, 14, -1, 15, -1)),
        _mm_shuffle_epi8(x2, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1,
                                           4, 12, 5, 13, 6, 14, 7, 15)),
        _mm_shuffle_epi8(x2, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1,
                                           -1, 8, -1, 9, -1, 10, -1, 11)),
        0xFE);
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scm)), dd);
    // slot 4q + v: run 4v + q of x's order, block 0 2 1 3 4 6 5 7 [(4v + q) / 2]
    *sw = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 2, 8, 10, 0, 2, 8, 10, 4, 6, 12, 14, 4, 6, 12, 14), f);
    *ow = f;  // x's sm is 0 at even lanes
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16);
    for (int c = 0; c < 2; c++) {
        const __m512i L = _mm512_loadu_si512(qs + 64 * c);
        W[2 * c] = _mm512_and_si512(L, nib);                         // blocks 4c, 4c + 2
        W[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(L, 4), nib);  // 4c + 1, 4c + 3
    }
    if (fmt == Q5_K) {  // block j's fifth bits: bit j of qh's 32 bytes
        const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        for (int v = 0; v < 4; v++) {
            const int j = 4 * (v / 2) + (v & 1);
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << j)),
                                                   _mm256_set1_epi8((char)(1 << (j + 2))), 1);
            W[v] = _mm512_mask_add_epi8(W[v], _mm512_test_epi8_mask(H, bit), W[v],
                                        _mm512_set1_epi8(16));
        }
    }
}

// 256 A + B in each int32 lane (4 products of a 64-weight vector): exact, |.| < 2^23; with
// `one` digit A alone.
static inline __attribute__((always_inline)) __m512i dot64(__m512i w, const int8_t *a,
                                                           const int8_t *b, const int one)
{
    const __m512i va = _mm512_loadu_si512(a);
#ifdef __AVX512VNNI__
    const __m512i da = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, va);
    if (one) return da;
    const __m512i vb = _mm512_loadu_si512(b);
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(da, 8), w, vb);
#else
    if (one) return _mm512_madd_epi16(_mm512_maddubs_epi16(w, va), _mm512_set1_epi16(1));
    const __m512i vb = _mm512_loadu_si512(b);
    const __m512i da = _mm512_madd_epi16(_mm512_maddubs_epi16(w, va), _mm512_set1_epi16(256));
    const __m512i db = _mm512_madd_epi16(_mm512_maddubs_epi16(w, vb), _mm512_set1_epi16(1));
    return _mm512_add_epi32(da, db);
#endif
}

static inline __attribute__((always_inline)) void row_kq(const uint8_t *xq, const int M,
                                                         int64_t xs, const uint8_t *wr,
                                                         const int fmt, const int one, int64_t K,
                                                         float *out, int64_t ldy)
{
    const int bb = loom_kq_block_bytes(fmt);
    const int far = K / QK * bb >= FAR_ROW;
    __m512 acc[M_MAX][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    // Q4_K / Q5_K: the next super-block unpacked a step ahead (its scales' latency hidden:
    // 0.94x; not Q6_K's: 1.01-1.05x)
    const int ahead = !runs16(fmt);
    __m512i Wn[4];
    __m512 swn, own;
    if (ahead) unpack512(wr, fmt, Wn, &swn, &own);
    for (int64_t s = 0; s < K / QK; s++) {
        const uint8_t *blk = wr + s * bb;
        prefetch_block(blk, bb, far);
        if (!ahead) unpack512(blk, fmt, Wn, &swn, &own);
        const __m512i W[4] = {Wn[0], Wn[1], Wn[2], Wn[3]};
        const __m512 sw = swn, ow = own;
        if (ahead && s + 1 < K / QK) unpack512(blk + bb, fmt, Wn, &swn, &own);
        for (int m = 0; m < M; m++) {
            const int8_t *a = (const int8_t *)(xq + m * xs) + s * QK, *b = a + K;
            const float *dr = (const float *)(xq + m * xs + 2 * K) + s * 16, *sm = dr + K / RUN;
            const __m512 sh = _mm512_mul_ps(sw, _mm512_loadu_ps(dr));  // dr_slot order
#define KQ_V(v, imm)                                                                          \
    acc[m][v & 1] = _mm512_fmadd_ps(                                                          \
        _mm512_cvtepi32_ps(dot64(W[v], a + 64 * v, b + 64 * v, one)), _mm512_permute_ps(sh, imm), \
        acc[m][v & 1])
            KQ_V(0, 0x00);
            KQ_V(1, 0x55);
            KQ_V(2, 0xAA);
            KQ_V(3, 0xFF);
#undef KQ_V
            acc[m][0] = _mm512_fnmadd_ps(ow, _mm512_loadu_ps(sm), acc[m][0]);
        }
    }
    for (int m = 0; m < M; m++)
        out[m * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

#elif defined(KQ_AVX2)
// x as one int16 X = 256 a + b a value (exact: |X| <= 32640), a sub-block of 32's even values
// then its odd ones (quantize_row): int16 lane l of a 32-byte load of nibbles holds weights 2l
// and 2l + 1 of a sub-block, so masks and shifts give them as int16 and `vpmaddwd` takes
// 16 products an instruction, not 32 `vpmaddubsw` products a digit plus a `vpmaddwd` to widen
// each (5 -> 3 multiply-port ops a 32 weights with the fma). Lane k of the two products' sum
// holds weights 4k .. 4k + 3, as the byte form's did: the same integers, the same bits.

// A super-block's weight scales sw as two halves, and ow, its offsets against x's sm (a run's:
// Q6_K 32 sw, Q3_K 4 sw, Q2_K dmin m; Q4_K / Q5_K: ow[0] = dmin m a sub-block of 32).
static inline __attribute__((always_inline)) void scales256(const uint8_t *blk, const int fmt,
                                                            __m256 sw[2], __m256 ow[2])
{
    const __m128i order =  // dr_slot order
        _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    if (fmt == Q6_K || fmt == Q3_K) {  // int8 scales (Q3_K's decoded, less 32)
        const __m128i raw = fmt == Q3_K ? q3_scales128(blk)
                                        : _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(f16_at(blk + (fmt == Q6_K ? 208 : 108)));
        const __m128i sc = _mm_shuffle_epi8(raw, order);
        for (int i = 0; i < 2; i++) {
            sw[i] = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(i ? _mm_unpackhi_epi64(sc, sc) : sc)), d);
            ow[i] = _mm256_mul_ps(sw[i], _mm256_set1_ps(fmt == Q6_K ? 32.0f : 4.0f));
        }
        return;
    }
    if (fmt == Q2_K) {  // scales in the low nibbles, minimums (its offsets) in the high
        const __m256 d = _mm256_set1_ps(f16_at(blk + 80)), dmin = _mm256_set1_ps(f16_at(blk + 82));
        const __m128i sm = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)blk), order);
        for (int i = 0; i < 2; i++) {
            const __m256i v = _mm256_cvtepu8_epi32(i ? _mm_unpackhi_epi64(sm, sm) : sm);
            sw[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))),
                                  d);
            ow[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), dmin);
        }
        return;
    }
    uint64_t sc8, mn8;
    k4_words(blk + 4, &sc8, &mn8);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8)));
    const __m256 d = _mm256_set1_ps(f16_at(blk));
    // dr_slot order: half i's slot 4q + v holds run 8i + 2v + q, of block 4i + v
    sw[0] = _mm256_mul_ps(_mm256_permute2f128_ps(sc, sc, 0x00), d);
    sw[1] = _mm256_mul_ps(_mm256_permute2f128_ps(sc, sc, 0x11), d);
    ow[0] = ow[1] = _mm256_mul_ps(mn, _mm256_set1_ps(f16_at(blk + 2)));
}

// Half c of a super-block (weights 128c + 32v + j, v < 4) as int16: E[v] its sub-block's even
// weights (j = 2l in lane l), O[v] its odd ones.
static inline __attribute__((always_inline)) void unpack_half(const uint8_t *blk, const int fmt,
                                                              const int c, __m256i E[4],
                                                              __m256i O[4])
{
    const __m256i n0 = _mm256_set1_epi16(0x000F);
    if (fmt == Q2_K || fmt == Q3_K) {  // qs 32c + j: weight 128c + 32v + j in its bits 2v,
        // 2v + 1 (Q6_K's qh); Q3_K's third bit: bit 4c + v of byte j of its first 32, moved to
        // bit 2 of the byte (shifts by 16-bit lanes, masked a byte)
        const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + (fmt == Q2_K ? 16 : 32) +
                                                               32 * c));
        const __m256i HM = _mm256_loadu_si256((const __m256i *)blk);  // Q3_K's third bits
        const __m256i lo = _mm256_set1_epi16(0x00FF);
        for (int v = 0; v < 4; v++) {
            __m256i W = _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * v)),
                                         _mm256_set1_epi8(3));
            if (fmt == Q3_K) {
                const int b = 4 * c + v;
                const __m256i hb = b >= 2 ? _mm256_srl_epi16(HM, _mm_cvtsi32_si128(b - 2))
                                          : _mm256_sll_epi16(HM, _mm_cvtsi32_si128(2 - b));
                W = _mm256_or_si256(W, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
            }
            E[v] = _mm256_and_si256(W, lo);
            O[v] = _mm256_srli_epi16(W, 8);
        }
        return;
    }
    if (fmt == Q6_K) {  // as bytes (ql 64c + j: weights 128c + j low, 128c + 64 + j high;
        // qh 32c + j: bits 4-5 of 128c + 32v + j in its bits 2v, 2v + 1), then split
        const __m256i nib = _mm256_set1_epi8(15), b45 = _mm256_set1_epi8(0x30);
        const __m256i lo = _mm256_set1_epi16(0x00FF);
        const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
        const __m256i L0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c));
        const __m256i L1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32));
        __m256i W[4];
        W[0] = _mm256_or_si256(_mm256_and_si256(L0, nib),
                               _mm256_and_si256(_mm256_slli_epi16(H, 4), b45));
        W[1] = _mm256_or_si256(_mm256_and_si256(L1, nib),
                               _mm256_and_si256(_mm256_slli_epi16(H, 2), b45));
        W[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), nib),
                               _mm256_and_si256(H, b45));
        W[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), nib),
                               _mm256_and_si256(_mm256_srli_epi16(H, 2), b45));
        for (int v = 0; v < 4; v++) {
            E[v] = _mm256_and_si256(W[v], lo);
            O[v] = _mm256_srli_epi16(W[v], 8);
        }
        return;
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16);
    if (fmt == Q5_K) {  // as bytes, the fifth bit (bit t of qh byte j: weight 32t + j's 16) or'ed
        // in at bit 4 (shifts by 16-bit lanes, masked a byte), then split
        const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const __m256i nib = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(0x10);
        const __m256i lo = _mm256_set1_epi16(0x00FF);
        for (int v = 0; v < 4; v++) {
            const __m256i L = _mm256_loadu_si256((const __m256i *)(qs + 64 * c + 32 * (v / 2)));
            const int t = 4 * c + v;
            const __m256i he = t <= 4 ? _mm256_sll_epi16(H, _mm_cvtsi32_si128(4 - t))
                                      : _mm256_srl_epi16(H, _mm_cvtsi32_si128(t - 4));
            const __m256i W = _mm256_or_si256(
                _mm256_and_si256(v & 1 ? _mm256_srli_epi16(L, 4) : L, nib),
                _mm256_and_si256(he, b4));
            E[v] = _mm256_and_si256(W, lo);
            O[v] = _mm256_srli_epi16(W, 8);
        }
        return;
    }
    for (int j = 0; j < 2; j++) {  // bytes 32(2c + j) + l: weights 64(2c + j) + l and + 32 + l
        const __m256i L = _mm256_loadu_si256((const __m256i *)(qs + 64 * c + 32 * j));
        E[2 * j] = _mm256_and_si256(L, n0);
        O[2 * j] = _mm256_and_si256(_mm256_srli_epi16(L, 8), n0);
        E[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(L, 4), n0);
        O[2 * j + 1] = _mm256_srli_epi16(L, 12);
    }
}

static inline __attribute__((always_inline)) void row_kq(const uint8_t *xq, const int M,
                                                         int64_t xs, const uint8_t *wr,
                                                         const int fmt, const int one, int64_t K,
                                                         float *out, int64_t ldy)
{
    (void)one;  // X holds one digit or two alike
    const int bb = loom_kq_block_bytes(fmt);
    const int far = K / QK * bb >= FAR_ROW;
    __m256 acc[M_MAX][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < K / QK; s++) {
        const uint8_t *blk = wr + s * bb;
        prefetch_block(blk, bb, far);
        __m256 sw[2], ow[2];
        scales256(blk, fmt, sw, ow);
        for (int i = 0; i < 2; i++) {
            __m256i E[4], O[4];
            unpack_half(blk, fmt, i, E, O);
            for (int m = 0; m < M; m++) {
                const int16_t *X = (const int16_t *)(xq + m * xs) + s * QK + 128 * i;
                const float *dr = (const float *)(xq + m * xs + 2 * K) + s * 16,
                            *sm = dr + K / RUN;
                const __m256 sh = _mm256_mul_ps(sw[i], _mm256_loadu_ps(dr + 8 * i));
#define KQ_V(v, imm)                                                                         \
    acc[m][v & 1] = _mm256_fmadd_ps(                                                        \
        _mm256_cvtepi32_ps(_mm256_add_epi32(                                                \
            _mm256_madd_epi16(E[v], _mm256_loadu_si256((const __m256i *)(X + 32 * v))),      \
            _mm256_madd_epi16(O[v], _mm256_loadu_si256((const __m256i *)(X + 32 * v + 16))))), \
        _mm256_permute_ps(sh, imm), acc[m][v & 1])
                KQ_V(0, 0x00);
                KQ_V(1, 0x55);
                KQ_V(2, 0xAA);
                KQ_V(3, 0xFF);
#undef KQ_V
                if (runs16(fmt) || i == 1)
                    acc[m][0] = _mm256_fnmadd_ps(ow[i], _mm256_loadu_ps(sm + 8 * i), acc[m][0]);
            }
        }
    }
    for (int m = 0; m < M; m++) {
        const __m256 t = _mm256_add_ps(acc[m][0], acc[m][1]);
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        out[m * ldy] = _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
    }
}

#elif defined(KQ_NEON)
// AArch64 NEON (sdot, or without dot products its widening-multiply form: neon_dot.h): a
// super-block's 256 integers unpacked into 16 int8 vectors, one a run
// of 16 in weight order (Q4_K / Q5_K: q as stored, 0..31; Q6_K: q - 32, so its offsets' term
// vanishes; Q2_K / Q3_K: q, unpacked portably); against each x row's digits of the run (x's runs
// in natural order), sdot sums four products in each of four int32 lanes: 256 (a . q) + b . q,
// and four runs' lanes are added pairwise (addp) into one vector of their four sums, converted
// and scaled once (the runs' weight scales times their d / 256). The offsets' terms (Q4_K /
// Q5_K: dmin m against each sub-block's sum of x~; Q2_K / Q3_K: a run's) come once a
// super-block. An output's sum runs in the same order whatever M.

// Run h's weights of a Q4_K / Q5_K / Q6_K super-block as int8: q[h]; other formats through
// block_values.
static inline __attribute__((always_inline)) void unpack_neon(const uint8_t *blk, const int fmt,
                                                              int8x16_t q[16])
{
    if (fmt == Q4_K || fmt == Q5_K) {  // bytes 32j + 16u + i: runs 4j + u (low), 4j + 2 + u
        const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16);
        const uint8x16_t nib = vdupq_n_u8(15), b4 = vdupq_n_u8(16);
        for (int j = 0; j < 4; j++)
            for (int u = 0; u < 2; u++) {
                const uint8x16_t v = vld1q_u8(qs + 32 * j + 16 * u);
                uint8x16_t lo = vandq_u8(v, nib), hi = vshrq_n_u8(v, 4);
                if (fmt == Q5_K) {  // bit t of qh byte l: weight 32t + l's 16 (run 2t + l / 16)
                    const uint8x16_t h = vld1q_u8(blk + 16 + 16 * u);
                    lo = vorrq_u8(lo, vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(4 - 2 * j))), b4));
                    hi = vorrq_u8(hi, vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(3 - 2 * j))), b4));
                }
                q[4 * j + u] = vreinterpretq_s8_u8(lo);
                q[4 * j + 2 + u] = vreinterpretq_s8_u8(hi);
            }
        return;
    }
    if (fmt == Q6_K) {  // run 8c + k: ql 64c + 16k (k < 4: low nibbles, else k - 4's high ones),
        // bits 4-5 from qh 32c + 16 (k % 2), bits 2t, 2t + 1 (t = k / 2)
        const uint8x16_t nib = vdupq_n_u8(15), b45 = vdupq_n_u8(0x30), k32 = vdupq_n_u8(32);
        for (int c = 0; c < 2; c++) {
            uint8x16_t ql[4], qh[2];
            for (int i = 0; i < 4; i++) ql[i] = vld1q_u8(blk + 64 * c + 16 * i);
            for (int i = 0; i < 2; i++) qh[i] = vld1q_u8(blk + 128 + 32 * c + 16 * i);
            for (int k = 0; k < 8; k++) {
                const uint8x16_t lo = k < 4 ? vandq_u8(ql[k], nib) : vshrq_n_u8(ql[k - 4], 4);
                const uint8x16_t hb =
                    vandq_u8(vshlq_u8(qh[k % 2], vdupq_n_s8((int8_t)(4 - 2 * (k / 2)))), b45);
                q[8 * c + k] = vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(lo, hb), k32));
            }
        }
        return;
    }
    uint8_t v[QK] __attribute__((aligned(16)));
    block_values(blk, fmt, v);
    for (int h = 0; h < 16; h++) q[h] = vreinterpretq_s8_u8(vld1q_u8(v + RUN * h));
}

// A super-block's weight scales, four runs a vector (sw[k]: runs 4k .. 4k + 3), and its
// offsets: Q4_K / Q5_K dmin m of sub-blocks 0..3 and 4..7 (ow[0], ow[1]); Q2_K / Q3_K a run's
// (ow[k]); none for Q6_K.
static inline __attribute__((always_inline)) void scales_neon(const uint8_t *blk, const int fmt,
                                                              float32x4_t sw[4],
                                                              float32x4_t ow[4])
{
    if (fmt == Q4_K || fmt == Q5_K) {
        uint64_t sc8, mn8;
        k4_words(blk + 4, &sc8, &mn8);
        const uint16x8_t sc = vmovl_u8(vcreate_u8(sc8)), mn = vmovl_u8(vcreate_u8(mn8));
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        const float32x4_t s0 = vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(sc))), d);
        const float32x4_t s1 = vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(sc))), d);
        sw[0] = vzip1q_f32(s0, s0);  // a sub-block's scale for its two runs
        sw[1] = vzip2q_f32(s0, s0);
        sw[2] = vzip1q_f32(s1, s1);
        sw[3] = vzip2q_f32(s1, s1);
        ow[0] = vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(mn))), dmin);
        ow[1] = vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(mn))), dmin);
        return;
    }
    if (fmt == Q6_K) {
        const int16x8_t sc = vmovl_s8(vld1_s8((const int8_t *)blk + 192)),
                        sc2 = vmovl_s8(vld1_s8((const int8_t *)blk + 200));
        const float d = f16_at(blk + 208);
        sw[0] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(sc))), d);
        sw[1] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(sc))), d);
        sw[2] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(sc2))), d);
        sw[3] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(sc2))), d);
        return;
    }
    float s[16], o[16];
    block_scales(blk, fmt, s, o);
    for (int k = 0; k < 4; k++) {
        sw[k] = vld1q_f32(s + 4 * k);
        ow[k] = vld1q_f32(o + 4 * k);
    }
}

static inline __attribute__((always_inline)) void row_kq(const uint8_t *xq, const int M,
                                                         int64_t xs, const uint8_t *wr,
                                                         const int fmt, const int one, int64_t K,
                                                         float *out, int64_t ldy)
{
    const int bb = loom_kq_block_bytes(fmt);
    const int far = K / QK * bb >= FAR_ROW;
    float32x4_t acc[M_MAX];
    for (int m = 0; m < M; m++) acc[m] = vdupq_n_f32(0.0f);
    for (int64_t s = 0; s < K / QK; s++) {
        const uint8_t *blk = wr + s * bb;
        prefetch_block(blk, bb, far);
        int8x16_t q[16];
        float32x4_t sw[4], ow[4];
        unpack_neon(blk, fmt, q);
        scales_neon(blk, fmt, sw, ow);
        for (int m = 0; m < M; m++) {
            const int8_t *a = (const int8_t *)(xq + m * xs) + s * QK, *b = a + K;
            const float *dr = (const float *)(xq + m * xs + 2 * K) + s * 16, *sm = dr + K / RUN;
            for (int k = 0; k < 4; k++) {
                const int8x16x4_t ak = vld1q_s8_x4(a + 64 * k);
                int32x4_t g[4];
                if (one) {
                    for (int u = 0; u < 4; u++)
                        g[u] = loom_sdot(vdupq_n_s32(0), q[4 * k + u], ak.val[u]);
                } else {
                    const int8x16x4_t bk = vld1q_s8_x4(b + 64 * k);
                    for (int u = 0; u < 4; u++)
                        g[u] = loom_sdot(
                            vshlq_n_s32(loom_sdot(vdupq_n_s32(0), q[4 * k + u], ak.val[u]), 8),
                            q[4 * k + u], bk.val[u]);
                }
                const int32x4_t runs = vpaddq_s32(vpaddq_s32(g[0], g[1]), vpaddq_s32(g[2], g[3]));
                acc[m] = vfmaq_f32(acc[m], vcvtq_f32_s32(runs),
                                   vmulq_f32(sw[k], vld1q_f32(dr + 4 * k)));
            }
            if (fmt == Q4_K || fmt == Q5_K) {  // sm[8 + j]: sub-block j's sum of x~
                acc[m] = vfmsq_f32(acc[m], ow[0], vld1q_f32(sm + 8));
                acc[m] = vfmsq_f32(acc[m], ow[1], vld1q_f32(sm + 12));
            } else if (fmt != Q6_K) {
                for (int k = 0; k < 4; k++)
                    acc[m] = vfmsq_f32(acc[m], ow[k], vld1q_f32(sm + 4 * k));
            }
        }
    }
    for (int m = 0; m < M; m++) out[m * ldy] = vaddvq_f32(acc[m]);
}

#else
// Portable.
static inline __attribute__((always_inline)) void row_kq(const uint8_t *xq, const int M,
                                                         int64_t xs, const uint8_t *wr,
                                                         const int fmt, const int one, int64_t K,
                                                         float *out, int64_t ldy)
{
    const int bb = loom_kq_block_bytes(fmt);
    float acc[M_MAX][16];
    for (int m = 0; m < M; m++)
        for (int h = 0; h < 16; h++) acc[m][h] = 0.0f;
    for (int64_t s = 0; s < K / QK; s++) {
        const uint8_t *blk = wr + s * bb;
        __builtin_prefetch(blk + PF);
        uint8_t q[QK] __attribute__((aligned(16)));
        float sw[16], ow[16];
        block_scales(blk, fmt, sw, ow);
        block_values(blk, fmt, q);
        for (int m = 0; m < M; m++) {
            const int8_t *a = (const int8_t *)(xq + m * xs) + s * QK, *b = a + K;
            const float *dr = (const float *)(xq + m * xs + 2 * K) + s * 16, *sm = dr + K / RUN;
            for (int h = 0; h < 16; h++) {
                // the offsets' terms: sx a run (runs16), Q4_K / Q5_K sx a block of 32
                const float mt = runs16(fmt) ? ow[h] * sm[h]
                                 : h & 1 ? 0.0f : ow[h] * sm[8 + h / 2];
                int32_t ia = 0, ib = 0;
                for (int i = 0; i < RUN; i++) {
                    ia += q[RUN * h + i] * a[RUN * h + i];
                    ib += one ? 0 : q[RUN * h + i] * b[RUN * h + i];
                }
                acc[m][h] += (float)(one ? ia : 256 * ia + ib) * (sw[h] * dr[h]) - mt;
            }
        }
    }
    for (int m = 0; m < M; m++) {
        float t = 0.0f;
        for (int h = 0; h < 16; h++) t += acc[m][h];
        out[m * ldy] = t;
    }
}
#endif

#if defined(KQ_AVX512) && defined(__AVX512VNNI__)
#define KQ_R16 1
// x for the interleaved kernel: each sub-block of 32 values as R16_X bytes, its two runs'
// digits a (32 bytes) then b (32) (quantize_run's, so the same digits as the other layouts),
// then fp32 d / 256 of each run, the sub-block's sum of x~ (the runs' sums added) and a pad:
// one pointer a row and constant offsets (K / 16 x 40 bytes a row, as x_stride gives).
#define R16_X 80
static void quantize_r16(const float *x, int64_t K, uint8_t *buf)
{
    for (int64_t j = 0; j < K / 32; j++) {
        uint8_t *o = buf + j * R16_X;
        float *f = (float *)(o + 64);
        const float s0 =
            (float)quantize_run(x + 32 * j, (int8_t *)o, (int8_t *)o + 32, f, 0) * f[0];
        const float s1 = (float)quantize_run(x + 32 * j + 16, (int8_t *)o + 16, (int8_t *)o + 48,
                                             f + 1, 0) * f[1];
        f[2] = s0 + s1;
        f[3] = 0.0f;
    }
}

// acc + w's unsigned bytes against the four signed bytes at p in every lane: x's four values
// an embedded broadcast of the instruction's memory operand (`{1to16}`), not a broadcast
// instruction before it (GCC emits one for set1 of a load): the same integers, 0.95-0.97x the
// interleaved kernel's time at 1-8 rows (Zen 4).
static inline __m512i dp_bcast(__m512i acc, __m512i w, const int8_t *p)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

// Interleaved Q4_K (LOOM_KQ_R16): weight rows 16 g .. 16 g + 15 against M <= M_MAX x rows
// (quantize_r16). Lane r of every vector is weight row r: a run's two digits take 8 `vpdpbusd`
// for all 16 rows, `256 A + B` as in dot64, converted once and scaled by the run's d / 256,
// the sub-block's two runs then by the rows' d sc, the minimums' dmin m sx one fnmadd. The
// same order for every x row whatever M. out[m * ldy + r] (+ bias[r]).
static inline __attribute__((always_inline)) void group_r16(const uint8_t *xq, const int M,
                                                            int64_t xs, const uint8_t *wg,
                                                            int64_t K, const float *bias,
                                                            float *out, int64_t ldy)
{
    __m512 acc[M_MAX];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(15);
    const __m128i b6 = _mm_set1_epi8(63), b4 = _mm_set1_epi8(15), top = _mm_set1_epi8(0x30);
    for (int64_t s = 0; s < K / QK; s++) {
        const uint8_t *o = wg + s * LOOM_KQ_R16_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32)));
        __m128i S[12];  // scale byte t of the 16 rows
        for (int t = 0; t < 12; t++) S[t] = _mm_loadu_si128((const __m128i *)(o + 64 + 16 * t));
        for (int j = 0; j < 8; j++) {
            // ggml's get_scale_min_k4 for 16 rows: sc, m in 6 bits
            const __m128i sc =
                j < 4 ? _mm_and_si128(S[j], b6)
                      : _mm_or_si128(_mm_and_si128(S[j + 4], b4),
                                     _mm_and_si128(_mm_srli_epi16(S[j - 4], 2), top));
            const __m128i mn =
                j < 4 ? _mm_and_si128(S[j + 4], b6)
                      : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(S[j + 4], 4), b4),
                                     _mm_and_si128(_mm_srli_epi16(S[j], 2), top));
            const __m512 sw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
            const __m512 mw = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
            const uint8_t *q = o + 256 + 256 * j;
            for (int c = 0; c < 256; c += 64) __builtin_prefetch(q + PF + c);
            __m512i W[8];  // chunk c's weights 8c .. 8c + 3 (even), 8c + 4 .. 8c + 7 (odd)
            for (int c = 0; c < 4; c++) {
                const __m512i L = _mm512_loadu_si512(q + 64 * c);
                W[2 * c] = _mm512_and_si512(L, nib);
                W[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(L, 4), nib);
            }
            for (int m = 0; m < M; m++) {
                const uint8_t *xj = xq + m * xs + (s * 8 + j) * R16_X;
                const float *f = (const float *)(xj + 64);  // dr0, dr1, sx
                __m512 t = _mm512_setzero_ps();
                for (int h = 0; h < 2; h++) {
                    const int8_t *ah = (const int8_t *)xj + 16 * h, *bh = ah + 32;
                    __m512i A = dp_bcast(_mm512_setzero_si512(), W[4 * h], ah);
                    for (int u = 1; u < 4; u++)
                        A = dp_bcast(A, W[4 * h + u], ah + 4 * u);
                    A = _mm512_slli_epi32(A, 8);
                    for (int u = 0; u < 4; u++)
                        A = dp_bcast(A, W[4 * h + u], bh + 4 * u);
                    const __m512 fa = _mm512_cvtepi32_ps(A), dv = _mm512_set1_ps(f[h]);
                    t = h == 0 ? _mm512_mul_ps(fa, dv) : _mm512_fmadd_ps(fa, dv, t);
                }
                acc[m] = _mm512_fmadd_ps(t, sw, acc[m]);
                acc[m] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(f[2]), acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        _mm512_storeu_ps(out + m * ldy,
                         bias ? _mm512_add_ps(acc[m], _mm512_loadu_ps(bias)) : acc[m]);
}

// Weight rows [n0, n1) (multiples of 16) of interleaved w for M quantized x rows: each group
// past even tiles of at most M_MAX rows.
static void rows_r16(const uint8_t *xq, int64_t M, int64_t xs, const uint8_t *w, int64_t K,
                     int64_t n0, int64_t n1, const float *bias, float *y, int64_t ldy)
{
    for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t *wg = w + n / 16 * (K / QK) * LOOM_KQ_R16_BYTES;
        const float *bn = bias ? bias + n : NULL;
        for (int64_t m0 = 0, tiles = (M + M_MAX - 1) / M_MAX; m0 < M; tiles--) {
            const int64_t t = (M - m0 + tiles - 1) / tiles;
            const uint8_t *xt = xq + m0 * xs;
            float *yt = y + m0 * ldy + n;
            switch (t) {
#define R16_CASE(k) case k: group_r16(xt, k, xs, wg, K, bn, yt, ldy); break;
            R16_CASE(1) R16_CASE(2) R16_CASE(3) R16_CASE(4) R16_CASE(5) R16_CASE(6) R16_CASE(7)
            default: group_r16(xt, 8, xs, wg, K, bn, yt, ldy); break;
#undef R16_CASE
            }
            m0 += t;
        }
    }
}
#else
static void rows_r16(const uint8_t *xq, int64_t M, int64_t xs, const uint8_t *w, int64_t K,
                     int64_t n0, int64_t n1, const float *bias, float *y, int64_t ldy)
{
    (void)xq, (void)M, (void)xs, (void)w, (void)K, (void)n0, (void)n1, (void)bias, (void)y,
        (void)ldy;  // loom_kq_check refuses LOOM_KQ_R16 in this build
}
#endif

// x as `fmt`'s kernel reads it (stride bytes a row: x_stride).
static inline void quantize_x(const float *x, int64_t K, int fmt, uint8_t *buf)
{
#if defined(KQ_R16)
    if (fmt & LOOM_KQ_R16) {
        quantize_r16(x, K, buf);
        return;
    }
#endif
    quantize_row(x, K, fmt & 0xff, buf, fmt & LOOM_KQ_ONE_DIGIT);
}

// Weight row n for M <= M_MAX quantized rows (M, fmt and the digits constants in each case).
static void row_any(const uint8_t *xq, int M, int64_t xs, const uint8_t *w, int fmt, int64_t K,
                    int64_t n, const float *bias, float *y, int64_t ldy)
{
    const int one = fmt & LOOM_KQ_ONE_DIGIT;
    fmt &= 0xff;
    const uint8_t *wr = w + n * (K / QK) * loom_kq_block_bytes(fmt);
#define ROW(m, f, o) row_kq(xq, m, xs, wr, f, o, K, y + n, ldy)
#define CASES(f, o) switch (M) { \
    case 1: ROW(1, f, o); break; case 2: ROW(2, f, o); break; case 3: ROW(3, f, o); break; \
    case 4: ROW(4, f, o); break; case 5: ROW(5, f, o); break; case 6: ROW(6, f, o); break; \
    case 7: ROW(7, f, o); break; default: ROW(8, f, o); break; }
#define DIGITS(f) if (one) { CASES(f, 1) } else { CASES(f, 0) }
    if (fmt == Q4_K) {
        DIGITS(Q4_K)
    } else if (fmt == Q5_K) {
        DIGITS(Q5_K)
    } else if (fmt == Q6_K) {
        DIGITS(Q6_K)
    } else if (fmt == Q3_K) {
        DIGITS(Q3_K)
    } else {
        DIGITS(Q2_K)
    }
#undef DIGITS
#undef CASES
#undef ROW
    if (bias)
        for (int m = 0; m < M; m++) y[m * ldy + n] += bias[n];
}

// Weight rows [n0, n1) for M quantized rows: blocks of KQ_BLOCK weight rows, each run past the x
// rows in one tile, or past KQ_ONE_TILE rows in even tiles of at most KQ_TILE (a block stays in
// cache for all of them). On AVX-512, at seven or eight x rows their digits (40 KB at K = 2048)
// and a weight row no longer fit in L1 together: two tiles of four ran the 1.7B shape's layers in
// 0.84-0.94x the time (one thread), its decode step at eight streams 207 -> 181 ms; at four to
// six rows tiles of two or three ran 1.0-1.2x (each tile unpacks the weights again), and the
// AVX2 build's eight rows 1.02-1.05x in two tiles. An x row's sums do not depend on its tile.
static void rows_kq(const uint8_t *xq, int64_t M, int64_t xs, const uint8_t *w, int fmt,
                    int64_t K, int64_t n0, int64_t n1, const float *bias, float *y, int64_t ldy)
{
    if (fmt & LOOM_KQ_R16) {
        rows_r16(xq, M, xs, w, K, n0, n1, bias, y, ldy);
        return;
    }
    const int64_t tiles0 = M <= KQ_ONE_TILE ? 1 : (M + KQ_TILE - 1) / KQ_TILE;
    for (int64_t b0 = n0; b0 < n1; b0 += KQ_BLOCK) {
        const int64_t b1 = b0 + KQ_BLOCK < n1 ? b0 + KQ_BLOCK : n1;
        for (int64_t m0 = 0, tiles = tiles0; m0 < M; tiles--) {
            const int64_t t = (M - m0 + tiles - 1) / tiles;
            for (int64_t n = b0; n < b1; n++)
                row_any(xq + m0 * xs, (int)t, xs, w, fmt, K, n, bias, y + m0 * ldy, ldy);
            m0 += t;
        }
    }
}

// The calling thread's buffer for `rows` quantized rows of K (kept, grown as needed).
static uint8_t *x_buffer(int64_t rows, int64_t K)
{
    static __thread uint8_t *buf;
    static __thread size_t have;
    const size_t need = (size_t)(rows * x_stride(K));
    if (have < need) {
        free(buf);
        have = 0;
        buf = aligned_alloc(64, (need + 63) & ~(size_t)63);
        if (!buf) return NULL;
        have = need;
    }
    return buf;
}

// x: [M, K] rows ldx floats apart; w: [N, K / 256] super-blocks of `fmt` (10 Q2_K, 11 Q3_K,
// 12 Q4_K, 13 Q5_K, 14 Q6_K; or'ed with LOOM_KQ_ONE_DIGIT or not), rows contiguous; bias: [N]
// or NULL; y: [M, N] rows ldy floats apart. Returns 0, -1 on bad K or fmt, -2 when the buffer
// for the quantized x cannot be allocated.
int loom_linear_kq(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int fmt,
                   const float *bias, int64_t N, float *y, int64_t ldy, int num_threads)
{
    if (loom_kq_check(K, fmt & ~LOOM_KQ_ONE_DIGIT)) return -1;
    if ((fmt & LOOM_KQ_R16) && ((fmt & LOOM_KQ_ONE_DIGIT) || N % 16)) return -1;
    if (M <= 0) return 0;  // (row_any takes 1 to 8 rows)
    const int64_t xs = x_stride(K);
    uint8_t *xq = x_buffer(M, K);
    if (!xq) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M > M_MAX)
    for (int64_t m = 0; m < M; m++)
        quantize_x(x + m * ldx, K, fmt, xq + m * xs);
    const int64_t units = (N + NB_ROWS - 1) / NB_ROWS;
    // guided chunks (as linear_q8.c): a thread the OS lends away leaves its rows to the others
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t u = 0; u < units; u++)
        rows_kq(xq, M, xs, w, fmt, K, u * NB_ROWS, (u + 1) * NB_ROWS < N ? (u + 1) * NB_ROWS : N,
                bias, y, ldy);
    return 0;
}

// For loom_linear_kq_team in a thread of a team: reserves the calling thread's buffer for
// LOOM_KQ_R16_INT_ROWS quantized rows of up to K_max. 0, or -2 if it cannot be allocated.
int loom_linear_kq_reserve(int64_t K_max)
{
    return x_buffer(LOOM_KQ_R16_INT_ROWS, K_max) ? 0 : -2;
}

// loom_linear_kq for M rows where loom_kq_int_rows (K and fmt as loom_kq_check takes: the
// caller checks) in a thread of a running OpenMP team (as linear_q8.c's loom_linear_q8_team):
// every thread calls it with the same arguments and `next` zeroed beforehand, after
// loom_linear_kq_reserve(K) in it; each quantizes x into its own buffer and takes guided chunks
// of weight rows from *next (interleaved rows: whole groups of 16). The same bits as
// loom_linear_kq.
void loom_linear_kq_team(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         int fmt, const float *bias, int64_t N, float *y, int64_t ldy,
                         int64_t *next, int team)
{
    if (M <= 0) return;
    const int64_t xs = x_stride(K);
    uint8_t *xq = x_buffer(M, K);  // reserved: no failure
    for (int64_t m = 0; m < M; m++)
        quantize_x(x + m * ldx, K, fmt, xq + m * xs);
    const int64_t g = fmt & LOOM_KQ_R16 ? 16 : 1;  // interleaved: whole groups of 16 rows
    for (int64_t u0, u1; loom_take_units(next, N / g, 16 / g, team, &u0, &u1);)
        rows_kq(xq, M, xs, w, fmt, K, g * u0, g * u1, bias, y, ldy);
}
