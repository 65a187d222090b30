// The int8 linear of linear_q8.c for decode (steps of up to 8 rows; on AArch64 every step) in
// integer dot products (AVX512-VNNI's vpdpwssd: 32 products of int16 pairs a vector; AVX2's
// vpmaddwd, AArch64's sdot: the AVX2 and NEON sections below): y[M, N] = x[M, K] @
// dequant(w)[N, K]^T + bias, w ~ q * scale + min in groups of 32 along K, the scales and
// minimums read as fp16.
//
// One stream's decode on the AVX kernel is bound partly by instructions: each weight is widened
// to fp32, scaled and multiplied on its own. Here x is quantized instead: each group of 32
// values of an x row gets one scale d (its largest magnitude / 127) and two int8 digits a and
// b, x / d = a + b / 256 (to 1/512 of d: 16 significant bits), held as one int16 X = 256 a + b
// (|X| <= 32639); a group's sum_k q_w[k] x[k] is d * sum q_w X / 256 in exact integers. The
// minimum's term takes the same x~, so an output is dequant(w) . x~ to fp32 rounding. One digit
// (llama.cpp's Q8 activations) measured 96.5% top-1 agreement with the fp32 reference on 1495
// positions; two, 99.9%.
//
// Scales and minimums come as fp16 (GGUF stores Q4_1's and Q8_0's so: exact there), a third
// fewer bytes per 4-bit weight than fp32 ones: at one stream the weights stream from memory.
//
// The bound at a few rows is the vector multiply ports: vpdpwssd, the fp32 scaling's mul and
// fma share them (one 512-bit op a cycle on a Zen 4). So the weights are read in blocks laid
// out (below) so that an int32 lane of vpdpwssd sums one group's products over the whole block,
// and a block's 16 lanes are converted and scaled once for 16 vpdpwssd (4-bit) instead of once
// for 4; each weight row is loaded and unpacked once for up to TILE x rows, its products
// summed in exact integers, any order. A unit's M x R sums reduce together in one tree of
// shuffles, each in the order of _mm512_reduce_add_ps. Every output is summed in the same order
// whatever M (and whatever rows are taken with it), so a row computes the same bits alone as
// with others (but not the AVX kernel's bits).

// Built without fast math (loom/kernels/build.py).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "loom.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define HAVE_VNNI 1
#define VNNI_512 1
#include <immintrin.h>
#include "lane_sums.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// AVX2 builds (x86-64-v3): the same integers, x's X and the weights' q as int16 pairs, in
// vpmaddwd (16 products into 8 int32 lanes) and vpaddd: see the AVX2 section below.
#define HAVE_VNNI 1
#include <immintrin.h>
#include "half.h"
#elif defined(__ARM_NEON) && defined(__aarch64__)
// AArch64 (the neon build with dot products: Graviton 2 and later, Apple M, Ampere Altra; the
// generic one without: Cortex-A53 / A72, Raspberry Pi 4): the same integers, x's two digits a
// and b as int8 against the weights' q as int8 in sdot (four products into each of four int32
// lanes; neon_dot.h) or its widening-multiply form: see the NEON section below.
#define HAVE_VNNI 1
#define VNNI_NEON 1
#include "neon_dot.h"
#endif

#define GROUP 32
#define M_MAX 8       // x rows a call quantizes at once (more run in chunks of M_MAX)
#define TILE 4        // x rows at once against a weight row (more: tiles of at most TILE)
// Weight rows a unit of work: two, read at once, as rows u and u + N / 2 (two streams through
// memory side by side) where that measured faster than neighbouring rows (one interleaved
// stream), in decode steps bound by reading the weights: 4-bit rows at one or two x rows (the
// 1.7B shape in Q4_0 took 1.4-1.6x the time as neighbours) and, when rows hold FAR_K weights
// or more, at any rows (1.1-1.3x at three to eight: 4-8 streams, speculation's verify steps;
// the 135M's short rows ran as well or better as neighbours there); 8-bit rows from two x rows
// (Gemma 3 270M's Q5_0 / Q8_0 layers and head at two streams: 1.5x; the 1.7B shape in Q8_0
// 1.2-1.3x at two to eight). At one x row the AVX-512 form runs 8-bit rows alone (far pairs took
// 1.09x the time on Gemma 3 on a Zen 4, and gained nothing on the 1.7B shape; neighbour pairs
// ran 640-wide rows 1.28x faster from L2 but took Gemma 3's stack step 1.125x the time); the
// AVX2 form pairs them far there too (Gemma 3's one-stream step, its 262144-row Q8_0 head, 0.91x
// the time on a Zen 3; the 135M's unchanged). docs/cpu_kernels.md.
#define UNIT 2
#define FAR_K 2048
#ifdef VNNI_512
#define R_OF(bits, M) ((bits) == 8 && (M) == 1 ? 1 : UNIT)  // rows at once
#define FAR_8(M) ((M) >= 2)                                 // 8-bit rows as far pairs
#elif defined(VNNI_NEON) && defined(__ARM_FEATURE_DOTPROD)  // 32 registers: a pair of weight
// rows at every M (0.92-0.96x the instructions of one row at a time at three to eight x rows,
// counted under qemu: untimed; sdot's widening-multiply form spills with a pair, 1.09x at four)
#define R_OF(bits, M) UNIT
#define FAR_8(M) 1
#else  // AVX2: past two x rows one weight row at a time (16 registers: a pair's sums spilled;
       // alone 0.82-0.95x the time at three to eight rows, one thread, Zen 4 as AVX2); AArch64
       // without dot products too
#define R_OF(bits, M) ((M) > 2 ? 1 : UNIT)
#define FAR_8(M) 1
#endif
// Each row's weights are prefetched PF_Q bytes ahead into L1 and PF_FAR bytes ahead into L2
// (prefetcht1): a core keeps more misses in flight to L2 than to L1. One row streaming from
// memory on two threads (Zen 4, bf16 and avx2 builds): an 8-bit 49152 x 2048 head in 0.77x the
// time, the 1.7B shape's 4-bit layers 0.81-0.97x. In the stack, in process: Gemma 3's one-stream
// step 0.95x on the bf16 build (its 640-wide rows too), but on the avx2 build rows under FAR_ROW
// bytes (the 135M's and Gemma 3's) measured 1.05x with it and go without there. L2 alone 8 KB
// ahead, without the L1 prefetch, took those narrow rows' heads 1.39-1.64x the time.
#define PF_Q 2048
#define PF_FAR 4096
#define FAR_ROW 1024  // the AVX2 form's narrowest row with the L2 prefetch
#define PF_S 128      // scales and minimums prefetched ahead
// Symmetric groups (mins NULL: Q4_0, Q8_0, IQ4_NL, IQ4_XS on the int8 grid): every group's
// minimum is -ZERO(bits, lv) times its scale, taken from the scales (a power of two: the same fp16
// product the stored minimum would be) instead of read, 2 bytes a group fewer (1/10 of Q4_0's
// bytes, 1/18 of Q8_0's).
#define ZERO(bits, lv) loom_q8_zero((lv) == LOOM_Q8_Q5 ? LOOM_Q8_Q5 : (bits) | (lv))
// LOOM_Q8_Q5 rows (K / 2 bytes of nibbles, then the fifth bits): the nibbles are read as 4-bit
// rows' (their x layout), and each unpacked vector of words gets 16 where its fifth bit is set
// (one mask a vector from the group's bits, one masked add; AVX2: a compare and a subtract).
#define LAYOUT(bits) (LOOM_Q8_WIDTH(bits) == 8 ? 8 : 4)  // the x layout's width

#define SCRATCH_X 3   // loom_scratch's slot for the quantized x

// 1 if this build has the VNNI kernel (the compiler targets AVX512-VNNI, AVX2 or AArch64), 0 if
// not.
int loom_vnni_available(void)
{
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_VNNI
// A row is read in blocks of BG(bits) groups, 256 bytes: sixteen 4-bit groups or eight 8-bit
// ones, four vectors v0..v3 of weight bytes, transposed in 128-bit lanes (vector j's dword
// 4b + i is dword j of v_i's lane b) so that a dword lane holds bytes of one group, and each
// transposed vector unpacked into XV(bits) vectors of 32 int16: vpdpwssd's int32 lane L then
// sums only its group's products over the whole block (4-bit: one lane a group; 8-bit: two),
// and a block's lanes are converted to fp32 and scaled once. The groups past the last block
// are read in chunks of CG(bits) groups, 64 bytes: four 4-bit groups or two 8-bit ones, one
// vector unpacked in place (lane k sums the chunk's bytes 4k .. 4k + 3).
//
// The quantized x of one row, for weights of `bits`, nb = groups / BG blocks, nc chunks past
// them:
//   X   int16 [nb][4][XV][32], [nc][XV][32]  the values in the order the weights unpack
//   dv  fp32 [nb + nc][16]  each int32 lane's d / 256 (its group's; 0 past the last group)
//   sx  fp32 [G16]          sum x~ a group (groups padded to 16 with zeros)
#define BG(bits) ((bits) == 4 ? 16 : 8)
#define CG(bits) ((bits) == 4 ? 4 : 2)
#define XV(bits) ((bits) == 4 ? 4 : 2)
typedef struct {
    int64_t blocks, chunks, dv, sx, stride;  // dv, sx: offsets in a row; stride: bytes a row
} XLayout;

static inline XLayout x_layout(int64_t K, int bits)
{
#ifdef VNNI_NEON  // a group's 64 bytes: its 32 digits a, then its 32 b (value order); dv, sx
    (void)bits;   // padded to a multiple of 4 groups
    const int64_t groups = K / GROUP, g4 = (groups + 3) / 4 * 4, dv = groups * 64;
    return (XLayout){0, groups, dv, dv + g4 * 4, (dv + g4 * 8 + 63) / 64 * 64};
#else
#ifdef VNNI_512
    const int64_t groups = K / GROUP, blocks = groups / BG(bits);
#else  // AVX2: chunks only
    const int64_t groups = K / GROUP, blocks = 0;
#endif
    const int64_t chunks = (groups - blocks * BG(bits) + CG(bits) - 1) / CG(bits);
    const int64_t g16 = (groups + 15) / 16 * 16, dv = (blocks * 4 + chunks) * XV(bits) * 64;
    const int64_t sx = dv + (blocks + chunks) * 64;
    return (XLayout){blocks, chunks, dv, sx, sx + g16 * 4};
#endif
}

#ifdef VNNI_512

// Where a value of a group goes in X, as (vector, word) with the vector's 32 words: in a block
// (group G of it), or in a chunk (group h of it). Value v is byte `at` of the group's bytes
// (4-bit: v mod 16, low nibble below 16; 8-bit: v), and in its 16-bit lane the byte's place t
// (at mod 4) picks the unpacked vector (t odd: the odd bytes) and the word (t >= 2: 2k + 1).
static inline int plane(int bits, int v)
{
    return bits == 4 ? (v >= 16 ? 2 : 0) + (v & 1) : (v & 1);
}

static inline int block_word(int bits, int G, int v)  // word index in the block's X
{
    const int at = bits == 4 ? 16 * G + (v & 15) : 32 * G + v;  // byte in the 256
    const int i = at / 64, b = (at % 64) / 16, j = (at % 16) / 4, t = at % 4;
    return (j * XV(bits) + plane(bits, v)) * 32 + 2 * (4 * b + i) + (t >> 1);
}

static inline int chunk_word(int bits, int h, int v)  // word index in the chunk's X
{
    const int at = bits == 4 ? 16 * h + (v & 15) : 32 * h + v;
    return plane(bits, v) * 32 + at / 2;
}

// Group h of chunk c (counted past the blocks) of one x row: its 32 X (value order) into the
// chunk's words, and d / 256 into the dv lanes that sum it (the AVX2 form's: put_group).
static inline void put_chunk_group(int16_t *X, float *dv, const XLayout L, int bits, int64_t c,
                                   int h, const int16_t *at, float d)
{
    int16_t *pc = X + (L.blocks * 4 + c) * XV(bits) * 32;
    for (int k = 0; k < 32; k++) pc[chunk_word(bits, h, k)] = at[k];
    const int lanes = 16 / CG(bits);
    for (int lane = h * lanes; lane < (h + 1) * lanes; lane++)
        dv[(L.blocks + c) * 16 + lane] = d / 256.0f;
}

// A block's lane L (= 4b + i: lane b of v_i) -> its group: 4-bit 4i + b, 8-bit 2i + b / 2.
static inline int block_group(int bits, int L)
{
    return bits == 4 ? 4 * (L % 4) + L / 4 : 2 * (L % 4) + L / 8;
}

// Lane -> its group in a chunk: a 4-bit chunk's 64 bytes hold groups 0..3, 16 bytes each
// (byte j holds values j and j + 16 in its low and high nibble), so int32 lanes 4h..4h + 3 sum
// group h; an 8-bit chunk is [g0 0..31, g1 0..31], lanes 8h..8h + 7.
static inline __m512i chunk_group(int bits)
{
    return bits == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                     : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

// The weights of 64 bytes v as int16 lanes, in XV(bits) vectors: 4-bit: the low nibbles of
// the even bytes, of the odd bytes, then the high nibbles of the even and of the odd bytes;
// 8-bit: the even bytes, then the odd ones. Word i of each vector comes from bytes 2i and
// 2i + 1, so vpdpwssd's lane k (words 2k, 2k + 1) sums bytes 4k .. 4k + 3. unpack_k: vector k
// alone (the block loop unpacks one at a time, as it multiplies them: fewer live registers).
static inline __attribute__((always_inline)) __m512i unpack_k(__m512i v, const int bits,
                                                              const int lv, const int k)
{
    if (bits != 4)
        return k == 0 ? _mm512_and_si512(v, _mm512_set1_epi16(0x00FF)) : _mm512_srli_epi16(v, 8);
    const __m512i nib = _mm512_set1_epi16(0x000F);
    const __m512i w = k == 0 ? _mm512_and_si512(v, nib)
                    : k == 1 ? _mm512_and_si512(_mm512_srli_epi16(v, 8), nib)
                    : k == 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)
                             : _mm512_srli_epi16(v, 12);
    if (lv != LOOM_Q8_LEVELS)
        return w;
    const __m512i t = _mm512_cvtepu8_epi16(  // each nibble i is the value loom_iq4_q[i] (vpermw)
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)loom_iq4_q)));
    return _mm512_permutexvar_epi16(w, t);
}

static inline __attribute__((always_inline)) void unpack(__m512i v, const int bits,
                                                         const int lv, __m512i *w)
{
    for (int k = 0; k < XV(bits); k++) w[k] = unpack_k(v, bits, lv, k);
}


// `rows` rows of x (ldx floats apart) into buf (x_layout(K, bits).stride bytes a row). Each
// group of 32: d = max |x| / 127, x / d = a + b / 256 + e with digits a = round(x / d) and
// b = round((x / d - a) * 256) (nearest even; b saturates at 127), |e| <= 1/512; X = 256 a + b.
static void quantize_x(const float *x, int64_t rows, int64_t K, int64_t ldx, int bits,
                       uint8_t *buf)
{
    const XLayout L = x_layout(K, bits);
    const int64_t groups = K / GROUP, in_blocks = L.blocks * BG(bits);
    const int bg = BG(bits), cg = CG(bits);
    const __m512 sign = _mm512_set1_ps(-0.0f), k256 = _mm512_set1_ps(256.0f);
    const __m512i lo8 = _mm512_set1_epi32(-128), hi8 = _mm512_set1_epi32(127);
    int16_t at[32];
    // A group's X in a block as 16 dwords: dword q holds values order[2q], order[2q + 1] and
    // lies lane_of[q] dwords past the group's first lane L0 of the block's first vector (in
    // 8-bit blocks values 16..31 take lane L0 + 4). From block_word of group 0 (L0 = 0).
    int16_t order[32];
    int32_t lane_of[16];
    for (int v = 0; v < 32; v++) {
        const int w = block_word(bits, 0, v);  // group 0: lane L0 = 0
        order[(w / 32) * 2 + (w % 2) + (bits == 8 && v >= 16 ? 16 : 0)] = (int16_t)v;
        lane_of[(w / 32) + (bits == 8 && v >= 16 ? 8 : 0)] = (w / 32) * 16 + (w % 32) / 2;
    }
    const __m512i to_dword = _mm512_loadu_si512((const void *)order);
    const __m512i to_lane = _mm512_loadu_si512((const void *)lane_of);
    for (int64_t m = 0; m < rows; m++) {
        const float *xr = x + m * ldx;
        int16_t *X = (int16_t *)(buf + m * L.stride);
        float *dv = (float *)(buf + m * L.stride + L.dv);
        float *sx = (float *)(buf + m * L.stride + L.sx);
        memset(X, 0, (size_t)(L.stride));  // X, dv and sx
        for (int64_t g = 0; g < groups; g++) {
            const __m512 v[2] = {_mm512_loadu_ps(xr + g * GROUP),
                                 _mm512_loadu_ps(xr + g * GROUP + 16)};
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_andnot_ps(sign, v[0]), _mm512_andnot_ps(sign, v[1])));
            const float d = amax / 127.0f;
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m512i xv[2];
            for (int half = 0; half < 2; half++) {
                const __m512 t = _mm512_mul_ps(v[half], inv);        // |t| <= 127
                const __m512i a = _mm512_cvtps_epi32(t);             // nearest even
                const __m512i b = _mm512_cvtps_epi32(                // t - a exact, in [-.5, .5]
                    _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(a)), k256));
                xv[half] = _mm512_add_epi32(_mm512_slli_epi32(a, 8),  // b: 128 -> 127
                                            _mm512_max_epi32(_mm512_min_epi32(b, hi8), lo8));
            }
            const __m512i words = _mm512_inserti64x4(  // the group's 32 X in value order
                _mm512_castsi256_si512(_mm512_cvtepi32_epi16(xv[0])),
                _mm512_cvtepi32_epi16(xv[1]), 1);
            if (g < in_blocks) {  // 16 dwords (two words each) to 16 vectors' lanes
                const int G = (int)(g % bg);
                const int L0 = block_word(bits, G, 0) / 2;  // value 0's dword: the first lane
                int32_t *pb = (int32_t *)(X + (g / bg) * 4 * XV(bits) * 32) + L0;
                _mm512_i32scatter_epi32(pb, to_lane, _mm512_permutexvar_epi16(to_dword, words),
                                        4);
                for (int lane = 0; lane < 16; lane++)
                    if (block_group(bits, lane) == G) dv[(g / bg) * 16 + lane] = d / 256.0f;
            } else {
                _mm512_storeu_si512((void *)at, words);
                put_chunk_group(X, dv, L, bits, (g - in_blocks) / cg, (int)((g - in_blocks) % cg),
                                at, d);
            }
            sx[g] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(xv[0], xv[1])) *
                    (d / 256.0f);
        }
    }
}

// The four vectors of a block (256 bytes at p) transposed in 128-bit lanes: u[j] dword 4b + i
// = dword j of lane b of vector i.
static inline __attribute__((always_inline)) void block_load(const uint8_t *p, __m512i *u)
{
    const __m512i v0 = _mm512_loadu_si512((const void *)p);
    const __m512i v1 = _mm512_loadu_si512((const void *)(p + 64));
    const __m512i v2 = _mm512_loadu_si512((const void *)(p + 128));
    const __m512i v3 = _mm512_loadu_si512((const void *)(p + 192));
    const __m512i t0 = _mm512_unpacklo_epi32(v0, v1), t1 = _mm512_unpackhi_epi32(v0, v1);
    const __m512i t2 = _mm512_unpacklo_epi32(v2, v3), t3 = _mm512_unpackhi_epi32(v2, v3);
    u[0] = _mm512_unpacklo_epi64(t0, t2);
    u[1] = _mm512_unpackhi_epi64(t0, t2);
    u[2] = _mm512_unpacklo_epi64(t1, t3);
    u[3] = _mm512_unpackhi_epi64(t1, t3);
}

// One chunk's products (XV vectors of W a row against each x row's) into acc, as lanes 0..7
// alone where only they hold weights (`half`).
static inline __attribute__((always_inline)) void chunk_vnni(
    const uint8_t *xq, const int M, int64_t xstride, int64_t at_x, int64_t at_d, const int bits,
    const int R, __m512i (*w)[4], const __m512 *s, const int half, __m512 *acc)
{
    const int nv = XV(bits);
    for (int m = 0; m < M; m++) {
        const uint8_t *xm = xq + m * xstride;
        if (half) {  // 256-bit halves
            __m256i x[4];
            for (int k = 0; k < nv; k++)
                x[k] = _mm256_load_si256((const void *)(xm + at_x + k * 64));
            const __m256 d = _mm256_load_ps((const float *)(xm + at_d));
            for (int r = 0; r < R; r++) {
                __m256i dot = _mm256_dpwssd_epi32(_mm256_setzero_si256(),
                                                  _mm512_castsi512_si256(w[r][0]), x[0]);
                for (int k = 1; k < nv; k++)
                    dot = _mm256_dpwssd_epi32(dot, _mm512_castsi512_si256(w[r][k]), x[k]);
                const __m256 lo = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm512_castps512_ps256(s[r]), d),
                    _mm512_castps512_ps256(acc[m * R + r]));
                acc[m * R + r] = _mm512_insertf32x8(acc[m * R + r], lo, 0);
            }
        } else {
            __m512i x[4];
            for (int k = 0; k < nv; k++)
                x[k] = _mm512_load_si512((const void *)(xm + at_x + k * 64));
            const __m512 d = _mm512_load_ps((const float *)(xm + at_d));
            for (int r = 0; r < R; r++) {
                __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w[r][0], x[0]);
                for (int k = 1; k < nv; k++) dot = _mm512_dpwssd_epi32(dot, w[r][k], x[k]);
                acc[m * R + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                                 _mm512_mul_ps(s[r], d), acc[m * R + r]);
            }
        }
    }
}

// The fifth bits of a 5-bit row's block (16 group words at h, group order) for its unpacked
// vectors: lane L (words 2L, 2L + 1) of hl (hh) holds the low (high) half of group
// block_group(L)'s word twice. Vector k of transposed vector j holds in word n the value
// 16 (k / 2) + 4 j + 2 (n % 2) + k % 2 of lane n / 2's group (block_word), so its mask tests
// bit 4 j + 2 (n % 2) + k % 2 of that half.
static inline __attribute__((always_inline)) void block_high(const uint8_t *h, __m512i gsel,
                                                             __m512i *hl, __m512i *hh)
{
    const __m512i w = _mm512_permutexvar_epi32(gsel, _mm512_loadu_si512((const void *)h));
    *hl = _mm512_shuffle_epi8(w, _mm512_broadcast_i32x4(_mm_setr_epi8(
                                     0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13)));
    *hh = _mm512_shuffle_epi8(w, _mm512_broadcast_i32x4(_mm_setr_epi8(
                                     2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15)));
}

// + 16 to the words of the XV = 4 unpacked vectors w whose bit (`bit` shifted by k % 2 for
// vector k) is set in hl (vectors 0, 1) or hh (2, 3).
static inline __attribute__((always_inline)) void add_high(__m512i *w, __m512i hl, __m512i hh,
                                                           __m512i bit)
{
    const __m512i k16 = _mm512_set1_epi16(16);
    for (int k = 0; k < 4; k++) {
        const __mmask32 set = _mm512_test_epi16_mask(k < 2 ? hl : hh,
                                                     _mm512_slli_epi16(bit, k % 2));
        w[k] = _mm512_mask_add_epi16(w[k], set, w[k], k16);
    }
}

// M <= TILE x rows (quantized, xq) against R <= UNIT weight rows from q, rstep rows apart
// (row_bytes a row; fp16 scales and minimums `groups` a row): out[m * ldy + r rstep] (+ bias[r
// rstep]). M, R, bits (4 or 8: the layout) and lv (LOOM_Q8_LEVELS, LOOM_Q8_Q5 with bits 4, or
// 0) are constants at each call site.
static inline __attribute__((always_inline)) void rows_vnni(
    const uint8_t *xq, const int M, int64_t xstride, const XLayout L, const uint8_t *q,
    int64_t row_bytes, const int bits, const int lv, const uint16_t *sc, const uint16_t *mn,
    int64_t groups, const int R, const int64_t rstep, const float *bias, float *out, int64_t ldy)
{
    const int64_t qs = rstep * row_bytes, ss = rstep * groups;  // from one row to the next
    __m512 acc[TILE * UNIT];  // [m * R + r]
    for (int i = 0; i < M * R; i++) acc[i] = _mm512_setzero_ps();
    const int bg = BG(bits), cg = CG(bits), nv = XV(bits);
    __m512i gsel;  // a block's lane -> its group
    {
        int32_t idx[16];
        for (int lane = 0; lane < 16; lane++) idx[lane] = block_group(bits, lane);
        gsel = _mm512_loadu_si512((const void *)idx);
    }
    for (int64_t bk = 0; bk < L.blocks; bk++) {
        for (int r = 0; r < R; r++)
            for (int line = 0; line < 256; line += 64) {
                __builtin_prefetch(q + r * qs + bk * 256 + line + PF_Q);
                __builtin_prefetch(q + r * qs + bk * 256 + line + PF_FAR, 0, 2);
            }
        if (bk % 2 == 0)
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(sc + r * ss + bk * bg + PF_S);
                if (mn) __builtin_prefetch(mn + r * ss + bk * bg + PF_S);
            }
        __m512i u[UNIT][4], hl[UNIT], hh[UNIT];
        __m512 s[UNIT];
        for (int r = 0; r < R; r++) {
            block_load(q + r * qs + bk * 256, u[r]);
            if (lv == LOOM_Q8_Q5) block_high(q + r * qs + groups * 16 + bk * 64, gsel, &hl[r],
                                             &hh[r]);
            const uint16_t *sr = sc + r * ss + bk * bg;
            const __m512 sg = bits == 4
                ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sr))
                : _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sr)));
            s[r] = _mm512_permutexvar_ps(gsel, sg);
        }
        // sum q X over the block, in S chains a sum (independent dependency chains where M R
        // is small): below 2^31 (|X| <= 32639, a lane: 32 products of q <= 15, or of
        // LOOM_Q8_LEVELS' q <= 241, or 16 of q <= 255), so exact in any order
        const int S = M * R >= 4 ? 1 : M * R >= 2 ? 2 : 4;
        __m512i dot[4][TILE * UNIT];
        for (int c = 0; c < S; c++)
            for (int i = 0; i < M * R; i++) dot[c][i] = _mm512_setzero_si512();
        // One unpacked vector k of a j at a time, multiplied as it comes (fewer live registers:
        // the 135M's steps of 1 to 8 rows 1.04-1.14x as fast); LOOM_Q8_Q5 rows unpack a j's
        // four at once (their fifth bits' masks: one at a time took 1.06x the time at 4 to 8
        // rows on the 1.7B shape in Q5_0).
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m512i w[UNIT][4];
            if (lv == LOOM_Q8_Q5)  // words: bit 4 j, then 4 j + 2
                for (int r = 0; r < R; r++) {
                    unpack(u[r][j], bits, lv, w[r]);
                    add_high(w[r], hl[r], hh[r], _mm512_set1_epi32(0x00040001 << 4 * j));
                }
#pragma GCC unroll 4
            for (int k = 0; k < nv; k++) {
                __m512i wk[UNIT];
                for (int r = 0; r < R; r++)
                    wk[r] = lv == LOOM_Q8_Q5 ? w[r][k] : unpack_k(u[r][j], bits, lv, k);
                for (int m = 0; m < M; m++) {
                    __m512i x = _mm512_load_si512(
                        (const void *)(xq + m * xstride + ((bk * 4 + j) * nv + k) * 64));
                    if (R > 1) __asm__("" : "+v"(x));  // one load for the R rows
                    for (int r = 0; r < R; r++)
                        dot[j % S][m * R + r] =
                            _mm512_dpwssd_epi32(dot[j % S][m * R + r], wk[r], x);
                }
            }
        }
        for (int c = 1; c < S; c++)
            for (int i = 0; i < M * R; i++) dot[0][i] = _mm512_add_epi32(dot[0][i], dot[c][i]);
        for (int m = 0; m < M; m++) {
            const __m512 d = _mm512_load_ps((const float *)(xq + m * xstride + L.dv) + bk * 16);
            for (int r = 0; r < R; r++)
                acc[m * R + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0][m * R + r]),
                                                 _mm512_mul_ps(s[r], d), acc[m * R + r]);
        }
    }
    const int64_t first = L.blocks * bg;  // the chunks past the blocks
    const __m512i csel = chunk_group(bits);
    for (int64_t c = 0; c < L.chunks; c++) {
        const int64_t g0 = first + c * cg, have = groups - g0 < cg ? groups - g0 : cg;
        const __mmask64 wk = have == cg ? ~0ull : (1ull << (have * GROUP * bits / 8)) - 1;
        const __mmask8 sk = (__mmask8)((1u << have) - 1);
        __m512i w[UNIT][4];
        __m512 s[UNIT];
        for (int r = 0; r < R; r++) {
            const uint8_t *p = q + r * qs + g0 * GROUP * bits / 8;
            unpack(_mm512_maskz_loadu_epi8(wk, p), bits, lv, w[r]);
            if (lv == LOOM_Q8_Q5) {
                // a chunk's vector k holds in word n the value 16 (k / 2) + 2 (n % 8) + k % 2
                // of group n / 8 (chunk_word): each word the right half of its group's bits
                const __m512i h = _mm512_castsi128_si512(
                    _mm_maskz_loadu_epi32(sk, q + r * qs + groups * 16 + g0 * 4));
                const __m512i to_lo = _mm512_set_epi16(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4,
                                                       4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0,
                                                       0, 0, 0, 0);
                add_high(w[r], _mm512_permutexvar_epi16(to_lo, h),
                         _mm512_permutexvar_epi16(
                             _mm512_add_epi16(to_lo, _mm512_set1_epi16(1)), h),
                         _mm512_set_epi16(16384, 4096, 1024, 256, 64, 16, 4, 1, 16384, 4096,
                                          1024, 256, 64, 16, 4, 1, 16384, 4096, 1024, 256, 64,
                                          16, 4, 1, 16384, 4096, 1024, 256, 64, 16, 4, 1));
            }
            const __m128i sh = _mm_maskz_loadu_epi16(sk, sc + r * ss + g0);
            s[r] = _mm512_permutexvar_ps(csel, _mm512_castps128_ps512(_mm_cvtph_ps(sh)));
        }
        const int64_t at_x = (L.blocks * 4 + c) * nv * 64, at_d = L.dv + (L.blocks + c) * 64;
        if (have * GROUP * bits / 8 <= 32)  // lanes 0..7 only
            chunk_vnni(xq, M, xstride, at_x, at_d, bits, R, w, s, 1, acc);
        else
            chunk_vnni(xq, M, xstride, at_x, at_d, bits, R, w, s, 0, acc);
    }
    for (int64_t g = 0; g < groups; g += 16) {  // + m_w * sum x~, 16 groups at once
        const __mmask16 k = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        for (int r = 0; r < R; r++) {
            const __m512 mins = mn
                ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + r * ss + g))
                : _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sc + r * ss + g)),
                                _mm512_set1_ps(-(float)ZERO(bits, lv)));
            for (int m = 0; m < M; m++) {
                const float *sx = (const float *)(xq + m * xstride + L.sx);
                acc[m * R + r] = _mm512_fmadd_ps(mins, _mm512_load_ps(sx + g), acc[m * R + r]);
            }
        }
    }
    float sums[TILE * UNIT];
    sum_lanes(acc, M * R, sums);
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++)
            out[m * ldy + r * rstep] =
                bias ? sums[m * R + r] + bias[r * rstep] : sums[m * R + r];
}
#elif defined(VNNI_NEON)
// x is laid out a group at a time in value order (x_layout), as the weights are: a 4-bit
// group's 16 bytes hold values j and j + 16 in byte j's low and high nibble, an 8-bit group's
// 32 bytes values 0..31. So a group is two int8 vectors of q (values 0..15, 16..31) against
// four of x (a's, then b's), and sdot's int32 lane i sums values 4i .. 4i + 3 of one vector:
// four lanes a group, 256 (a . q) + b . q in exact int32. Four groups' lanes are added pairwise
// into one vector of their four sums (vpaddq), converted and scaled once (each lane by its
// group's s_w * d / 256). sdot multiplies signed bytes: 4-bit q (0..15, 0..31 with LOOM_Q8_Q5's
// fifth bits) as they are, 8-bit q and the IQ4 levels (up to 255) as q - 128, whose 128 s_w x~
// is added to the minimum's term (min + 128 s_w: 0 for the symmetric groups of Q8_0 and IQ4).
// Every output is summed in one fixed order whatever M: the same bits alone and with others.

// `rows` rows of x into buf, as the AVX-512 quantize_x (the same digits, d and sum x~ a group).
static void quantize_x(const float *x, int64_t rows, int64_t K, int64_t ldx, int bits,
                       uint8_t *buf)
{
    const XLayout L = x_layout(K, bits);
    const int64_t groups = K / GROUP;
    for (int64_t m = 0; m < rows; m++) {
        const float *xr = x + m * ldx;
        int8_t *X = (int8_t *)(buf + m * L.stride);
        float *dv = (float *)(buf + m * L.stride + L.dv);
        float *sx = (float *)(buf + m * L.stride + L.sx);
        memset(dv, 0, (size_t)(L.stride - L.dv));  // the padding groups' d and sums: 0
        for (int64_t g = 0; g < groups; g++) {
            float32x4_t v[8], mx = vdupq_n_f32(0.0f);
            for (int i = 0; i < 8; i++) {
                v[i] = vld1q_f32(xr + g * GROUP + 4 * i);
                mx = vmaxq_f32(mx, vabsq_f32(v[i]));
            }
            const float amax = vmaxvq_f32(mx), d = amax / 127.0f;
            const float32x4_t inv = vdupq_n_f32(amax > 0.0f ? 127.0f / amax : 0.0f);
            int32x4_t sum = vdupq_n_s32(0);
            int16x8_t a16[4], b16[4];
            for (int i = 0; i < 4; i++) {
                int32x4_t a[2], b[2];
                for (int u = 0; u < 2; u++) {
                    const float32x4_t t = vmulq_f32(v[2 * i + u], inv);  // |t| <= 127
                    a[u] = vcvtnq_s32_f32(t);                          // nearest even
                    b[u] = vcvtnq_s32_f32(vmulq_f32(vsubq_f32(t, vcvtq_f32_s32(a[u])),
                                                    vdupq_n_f32(256.0f)));
                    b[u] = vmaxq_s32(vminq_s32(b[u], vdupq_n_s32(127)), vdupq_n_s32(-128));
                    sum = vaddq_s32(sum, vaddq_s32(vshlq_n_s32(a[u], 8), b[u]));
                }
                a16[i] = vcombine_s16(vmovn_s32(a[0]), vmovn_s32(a[1]));
                b16[i] = vcombine_s16(vmovn_s32(b[0]), vmovn_s32(b[1]));
            }
            int8_t *xg = X + g * 64;
            for (int h = 0; h < 2; h++) {
                vst1q_s8(xg + 16 * h,
                         vcombine_s8(vmovn_s16(a16[2 * h]), vmovn_s16(a16[2 * h + 1])));
                vst1q_s8(xg + 32 + 16 * h,
                         vcombine_s8(vmovn_s16(b16[2 * h]), vmovn_s16(b16[2 * h + 1])));
            }
            dv[g] = d / 256.0f;
            sx[g] = (float)vaddvq_s32(sum) * (d / 256.0f);
        }
    }
}

// n <= 4 fp16 words from p as floats, the rest zero.
static inline __attribute__((always_inline)) float32x4_t load_halves(const uint16_t *p, int n)
{
    uint16x4_t v = vdup_n_u16(0);
    if (n == 4) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
    switch (n) {
    case 3: v = vld1_lane_u16(p + 2, v, 2);  // fall through
    case 2: v = vld1_lane_u16(p + 1, v, 1);  // fall through
    default: v = vld1_lane_u16(p, v, 0);
    }
    return vcvt_f32_f16(vreinterpret_f16_u16(v));
}

// Group j's q of a row (its bytes at p) as two int8 vectors, values 0..15 and 16..31; h: the
// row's fifth bits (LOOM_Q8_Q5), levels: the IQ4 levels - 128 (LOOM_Q8_LEVELS).
static inline __attribute__((always_inline)) void group_q(const uint8_t *p, const int bits,
                                                          const int lv, const uint8_t *h,
                                                          uint8x16_t levels, int8x16_t *w)
{
    if (bits == 8) {  // q - 128
        w[0] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p), vdupq_n_u8(0x80)));
        w[1] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 16), vdupq_n_u8(0x80)));
        return;
    }
    const uint8x16_t v = vld1q_u8(p);
    uint8x16_t lo = vandq_u8(v, vdupq_n_u8(15)), hi = vshrq_n_u8(v, 4);
    if (lv == LOOM_Q8_LEVELS) {
        lo = vqtbl1q_u8(levels, lo);
        hi = vqtbl1q_u8(levels, hi);
    } else if (lv == LOOM_Q8_Q5) {  // bit v of the group's word: 16 to value v
        uint32_t word;
        memcpy(&word, h, 4);
        const uint8x16_t bytes = vreinterpretq_u8_u32(vdupq_n_u32(word));
        const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull));
        const uint8x16_t k16 = vdupq_n_u8(16);
        const uint8x16_t sel_lo = vcombine_u8(vdup_n_u8(0), vdup_n_u8(1));
        const uint8x16_t sel_hi = vcombine_u8(vdup_n_u8(2), vdup_n_u8(3));
        lo = vorrq_u8(lo, vandq_u8(vtstq_u8(vqtbl1q_u8(bytes, sel_lo), bit), k16));
        hi = vorrq_u8(hi, vandq_u8(vtstq_u8(vqtbl1q_u8(bytes, sel_hi), bit), k16));
    }
    w[0] = vreinterpretq_s8_u8(lo);
    w[1] = vreinterpretq_s8_u8(hi);
}

// Groups g0 .. g0 + n - 1 (n <= 4; the layout pads x's d and sums to 4 groups) of R weight rows
// against M x rows, into acc.
static inline __attribute__((always_inline)) void quad_vnni(
    const uint8_t *xq, const int M, int64_t xstride, const XLayout L, const uint8_t *q,
    int64_t qs, const int bits, const int lv, const uint16_t *sc, const uint16_t *mn,
    int64_t ss, int64_t groups, const int R, int64_t g0, const int n, const int far,
    uint8x16_t levels, float32x4_t *acc)
{
    const int gb = bits == 8 ? 32 : 16;  // bytes a group
    const float off = bits == 8 || lv == LOOM_Q8_LEVELS ? 128.0f : 0.0f;  // q's - off
    int8x16_t w[UNIT][8];
    float32x4_t s[UNIT], mins[UNIT];
    for (int r = 0; r < R; r++) {
        const uint8_t *p = q + r * qs + g0 * gb;
        for (int line = 0; line < 4 * gb; line += 64) {
            __builtin_prefetch(p + line + PF_Q);
            if (far) __builtin_prefetch(p + line + PF_FAR, 0, 2);
        }
        for (int j = 0; j < n; j++)
            group_q(p + j * gb, bits, lv, q + r * qs + groups * 16 + (g0 + j) * 4, levels,
                    w[r] + 2 * j);
        s[r] = load_halves(sc + r * ss + g0, n);
        mins[r] = mn ? vfmaq_n_f32(load_halves(mn + r * ss + g0, n), s[r], off)
                     : vmulq_n_f32(s[r], off - (float)ZERO(bits, lv));
    }
    for (int m = 0; m < M; m++) {
        const uint8_t *xm = xq + m * xstride;
        const float32x4_t d = vld1q_f32((const float *)(xm + L.dv) + g0);
        const float32x4_t sx = vld1q_f32((const float *)(xm + L.sx) + g0);
        int32x4_t dot[UNIT][4];
        for (int j = 0; j < 4; j++) {
            if (j >= n) {
                for (int r = 0; r < R; r++) dot[r][j] = vdupq_n_s32(0);
                continue;
            }
            const int8x16x4_t x = vld1q_s8_x4((const int8_t *)xm + (g0 + j) * 64);
            for (int r = 0; r < R; r++) {
                const int32x4_t a = loom_sdot(loom_sdot(vdupq_n_s32(0), w[r][2 * j], x.val[0]),
                                              w[r][2 * j + 1], x.val[1]);
                dot[r][j] = loom_sdot(loom_sdot(vshlq_n_s32(a, 8), w[r][2 * j], x.val[2]),
                                      w[r][2 * j + 1], x.val[3]);
            }
        }
        for (int r = 0; r < R; r++) {
            const int32x4_t g4 = vpaddq_s32(vpaddq_s32(dot[r][0], dot[r][1]),
                                            vpaddq_s32(dot[r][2], dot[r][3]));
            float32x4_t a = vfmaq_f32(acc[m * R + r], vcvtq_f32_s32(g4), vmulq_f32(s[r], d));
            acc[m * R + r] = vfmaq_f32(a, mins[r], sx);
        }
    }
}

// M <= TILE x rows against R <= UNIT weight rows, as the AVX-512 rows_vnni.
static inline __attribute__((always_inline)) void rows_vnni(
    const uint8_t *xq, const int M, int64_t xstride, const XLayout L, const uint8_t *q,
    int64_t row_bytes, const int bits, const int lv, const uint16_t *sc, const uint16_t *mn,
    int64_t groups, const int R, const int64_t rstep, const float *bias, float *out, int64_t ldy)
{
    const int64_t qs = rstep * row_bytes, ss = rstep * groups;
    const int far = row_bytes >= FAR_ROW;
    const uint8x16_t levels = veorq_u8(vld1q_u8(loom_iq4_q), vdupq_n_u8(0x80));
    float32x4_t acc[TILE * UNIT];  // [m * R + r]
    for (int i = 0; i < M * R; i++) acc[i] = vdupq_n_f32(0.0f);
    int64_t g0 = 0;
    for (; g0 + 4 <= groups; g0 += 4)
        quad_vnni(xq, M, xstride, L, q, qs, bits, lv, sc, mn, ss, groups, R, g0, 4, far, levels,
                  acc);
#define TAIL(n) quad_vnni(xq, M, xstride, L, q, qs, bits, lv, sc, mn, ss, groups, R, g0, n, \
                        far, levels, acc)
    switch (groups - g0) {  // the last 1 to 3 groups, each count a constant (with the count a
    case 3: TAIL(3); break; // variable, 1.07-1.09x the instructions on 576-wide rows: 18 groups)
    case 2: TAIL(2); break;
    case 1: TAIL(1); break;
    }
#undef TAIL
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            const float sum = vaddvq_f32(acc[m * R + r]);
            out[m * ldy + r * rstep] = bias ? sum + bias[r * rstep] : sum;
        }
}
#else  // AVX2
// x is laid out in chunks only (x_layout: no blocks), as the AVX-512 kernel lays out its chunks
// past the blocks, and each 64-byte chunk of a weight row (four 4-bit groups or two 8-bit ones)
// is read as two 32-byte halves: a half's bytes unpack into XV(bits) vectors of 16 int16, whose
// words meet the low (first half) or high 256 bits of the chunk's XV x vectors, and vpmaddwd's
// int32 lane k sums the half's bytes 4k .. 4k + 3: lanes 0..3 and 4..7 one 4-bit group each, or
// all eight one 8-bit group. A half's eight lanes are converted and scaled once (each lane by
// its group's s_w * d / 256) into eight fp32 sums a row, reduced at the end of the row in one
// fixed order: a row's bits do not depend on M nor on the rows beside it.

// Group h of chunk c of one x row (AVX2: chunks only), where the AVX-512 form's put_chunk_group
// places it, from v16: its values 0..15 (v16[0]) and 16..31 (v16[1]), each vector's even values
// in its low 128 bits and odd ones in its high: a 4-bit group's planes 0..3 take 8 words each,
// an 8-bit group's planes 0 and 1 (the even and the odd values) 16; d / 256 into its dv lanes.
static inline __attribute__((always_inline)) void put_group(int16_t *X, float *dv, int bits,
                                                            int64_t c, int h, const __m256i *v16,
                                                            float d)
{
    int16_t *pc = X + c * XV(bits) * 32;
    if (bits == 4) {
        for (int i = 0; i < 2; i++) {
            _mm_storeu_si128((__m128i *)(pc + 64 * i + 8 * h), _mm256_castsi256_si128(v16[i]));
            _mm_storeu_si128((__m128i *)(pc + 64 * i + 32 + 8 * h),
                             _mm256_extracti128_si256(v16[i], 1));
        }
        _mm_storeu_ps(dv + c * 16 + 4 * h, _mm_set1_ps(d / 256.0f));
    } else {
        _mm256_storeu_si256((__m256i *)(pc + 16 * h),
                            _mm256_permute2x128_si256(v16[0], v16[1], 0x20));
        _mm256_storeu_si256((__m256i *)(pc + 32 + 16 * h),
                            _mm256_permute2x128_si256(v16[0], v16[1], 0x31));
        _mm256_storeu_ps(dv + c * 16 + 8 * h, _mm256_set1_ps(d / 256.0f));
    }
}

// `rows` rows of x into buf, as the AVX-512 quantize_x (the same X, d and sum x~ a group).
static void quantize_x(const float *x, int64_t rows, int64_t K, int64_t ldx, int bits,
                       uint8_t *buf)
{
    const XLayout L = x_layout(K, bits);
    const int64_t groups = K / GROUP;
    const int cg = CG(bits);
    const __m256 sign = _mm256_set1_ps(-0.0f), k256 = _mm256_set1_ps(256.0f);
    const __m256i lo8 = _mm256_set1_epi32(-128), hi8 = _mm256_set1_epi32(127);
    // packs gives values 0..3, 8..11 | 4..7, 12..15: each lane's even words, then its odd ones
    // (dwords (0, 2), (8, 10), (1, 3), (9, 11) | (4, 6), (12, 14), (5, 7), (13, 15)), and the
    // dwords in value order: the even values, then the odd ones
    const __m256i evens_odds = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14,
                                                15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10,
                                                11, 14, 15);
    const __m256i pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = 0; m < rows; m++) {
        const float *xr = x + m * ldx;
        int16_t *X = (int16_t *)(buf + m * L.stride);
        float *dv = (float *)(buf + m * L.stride + L.dv);
        float *sx = (float *)(buf + m * L.stride + L.sx);
        memset(X, 0, (size_t)(L.stride));  // X, dv and sx
        for (int64_t g = 0; g < groups; g++) {
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xr + g * GROUP + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            const float d = amax / 127.0f;
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m256i xv[4], total = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256 t = _mm256_mul_ps(v[i], inv);          // |t| <= 127
                const __m256i a = _mm256_cvtps_epi32(t);            // nearest even
                const __m256i b = _mm256_cvtps_epi32(               // t - a exact
                    _mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(a)), k256));
                xv[i] = _mm256_add_epi32(  // b: 128 -> 127
                    _mm256_slli_epi32(a, 8), _mm256_max_epi32(_mm256_min_epi32(b, hi8), lo8));
                total = _mm256_add_epi32(total, xv[i]);
            }
            // the group's X in value order (packs interleaves 128-bit lanes), values 0..15 and
            // 16..31, each as its even values then its odd ones (chunk_word's planes)
            __m256i v16[2];
            for (int i = 0; i < 2; i++)
                v16[i] = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(
                    _mm256_packs_epi32(xv[2 * i], xv[2 * i + 1]), evens_odds), pairs);
            put_group(X, dv, bits, g / cg, (int)(g % cg), v16, d);
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total),
                                       _mm256_extracti128_si256(total, 1));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
            sx[g] = (float)_mm_cvtsi128_si32(t4) * (d / 256.0f);
        }
    }
}

// The 32 weight bytes of a half as XV(bits) vectors of 16 int16, in the order unpack (AVX-512)
// gives a chunk's: 4-bit: the low nibbles of the even bytes, of the odd bytes, then the high
// nibbles of the even and of the odd bytes; 8-bit: the even bytes, then the odd ones.
static inline __attribute__((always_inline)) void unpack_half(__m256i v, const int bits,
                                                              const int lv, __m256i *w)
{
    if (bits == 4) {
        const __m256i nib = _mm256_set1_epi16(0x000F);
        w[0] = _mm256_and_si256(v, nib);
        w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 8), nib);
        w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        w[3] = _mm256_srli_epi16(v, 12);
        if (lv == LOOM_Q8_LEVELS) {  // nibble i -> loom_iq4_q[i] by vpshufb, high byte zeroed
            const __m256i t = _mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)loom_iq4_q));
            const __m256i hi0 = _mm256_set1_epi16((short)0x8000);  // bit 7: a zero byte
            for (int k = 0; k < 4; k++)
                w[k] = _mm256_shuffle_epi8(t, _mm256_or_si256(w[k], hi0));
        }
    } else {
        w[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x00FF));
        w[1] = _mm256_srli_epi16(v, 8);
    }
}

// + 16 to the words of a 5-bit half's XV = 4 vectors w (unpack_half's) whose fifth bit is set:
// word n of vector k holds the value 16 (k / 2) + 2 (n % 8) + k % 2 of the half's group n / 8,
// whose bits (`have` groups) are 32-bit words at h.
static inline __attribute__((always_inline)) void high_half(const uint8_t *h, int have,
                                                            __m256i *w)
{
    uint32_t a, b = 0;
    memcpy(&a, h, 4);
    if (have == 2) memcpy(&b, h + 4, 4);
    const __m256i both = _mm256_setr_epi32((int)a, (int)a, (int)a, (int)a, (int)b, (int)b,
                                           (int)b, (int)b);
    const __m256i lo = _mm256_shuffle_epi8(both, _mm256_set1_epi16(0x0100));  // low half
    const __m256i hi = _mm256_shuffle_epi8(both, _mm256_set1_epi16(0x0302));  // high half
    const __m256i bit = _mm256_setr_epi16(1, 4, 16, 64, 256, 1024, 4096, 16384, 1, 4, 16, 64,
                                          256, 1024, 4096, 16384);
    for (int k = 0; k < 4; k++) {
        const __m256i c = _mm256_slli_epi16(bit, k % 2);
        const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(k < 2 ? lo : hi, c), c);
        w[k] = _mm256_sub_epi16(w[k], _mm256_slli_epi16(set, 4));  // -(-16)
    }
}

// n < 8 words from p in a vector's first n words, the rest zero, read one by one: copied into a
// zeroed buffer on the stack and loaded back as one vector, the narrow stores stall the wide
// load's forwarding (~8% of a call's time on 576-wide rows, whose 18 groups end in a tail of 2).
static inline __attribute__((always_inline)) __m128i load_words(const uint16_t *p, int n)
{
    __m128i v = _mm_setzero_si128();
    switch (n) {
    case 7: v = _mm_insert_epi16(v, p[6], 6);  // fall through
    case 6: v = _mm_insert_epi16(v, p[5], 5);  // fall through
    case 5: v = _mm_insert_epi16(v, p[4], 4);  // fall through
    case 4: v = _mm_insert_epi16(v, p[3], 3);  // fall through
    case 3: v = _mm_insert_epi16(v, p[2], 2);  // fall through
    case 2: v = _mm_insert_epi16(v, p[1], 1);  // fall through
    default: v = _mm_insert_epi16(v, p[0], 0);
    }
    return v;
}

// acc[m R + r] += the minimums of weight row r's groups g .. g + n - 1 (n <= 8; mn NULL: -zero
// times their scales) times x row m's sums x~ of those groups.
static inline __attribute__((always_inline)) void add_mins(
    const uint8_t *xq, const int M, int64_t xstride, const XLayout L, const uint16_t *mn,
    const uint16_t *sc, int64_t ss, const int zero, const int R, int64_t g, const int n,
    __m256 *acc)
{
    for (int r = 0; r < R; r++) {
        const uint16_t *mr = (mn ? mn : sc) + r * ss + g;
        __m256 mins = _mm256_cvtph_ps(n == 8 ? _mm_loadu_si128((const __m128i *)mr)
                                             : load_words(mr, n));
        if (!mn) mins = _mm256_mul_ps(mins, _mm256_set1_ps(-(float)zero));
        for (int m = 0; m < M; m++) {
            const float *sx = (const float *)(xq + m * xstride + L.sx);
            acc[m * R + r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(sx + g), acc[m * R + r]);
        }
    }
}

// The sum of v's eight lanes, always in this order.
static inline __attribute__((always_inline)) float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// M <= TILE x rows against R <= UNIT weight rows, as the AVX-512 rows_vnni.
static inline __attribute__((always_inline)) void rows_vnni(
    const uint8_t *xq, const int M, int64_t xstride, const XLayout L, const uint8_t *q,
    int64_t row_bytes, const int bits, const int lv, const uint16_t *sc, const uint16_t *mn,
    int64_t groups, const int R, const int64_t rstep, const float *bias, float *out, int64_t ldy)
{
    const int64_t qs = rstep * row_bytes, ss = rstep * groups;
    const int far = row_bytes >= FAR_ROW;
    const int cg = CG(bits), nv = XV(bits), hg = cg / 2;  // hg: groups a half (32 bytes)
    __m256 acc[TILE * UNIT];  // [m * R + r]
    for (int i = 0; i < M * R; i++) acc[i] = _mm256_setzero_ps();
    // a half's lane -> its group within the half's scales (4-bit: two groups, 8-bit: one)
    const __m256i hsel = bits == 4 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)
                                   : _mm256_setzero_si256();
    for (int64_t c = 0; c < L.chunks; c++) {
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(q + r * qs + c * 64 + PF_Q);
            if (far) __builtin_prefetch(q + r * qs + c * 64 + PF_FAR, 0, 2);
        }
        if (c % 4 == 0)
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(sc + r * ss + c * cg + PF_S);
                if (mn) __builtin_prefetch(mn + r * ss + c * cg + PF_S);
            }
        for (int half = 0; half < 2; half++) {
            const int64_t g0 = c * cg + half * hg;  // the half's first group
            if (g0 >= groups) break;
            const int have = groups - g0 < hg ? (int)(groups - g0) : hg;
            __m256i w[UNIT][4];
            __m256 s[UNIT];
            for (int r = 0; r < R; r++) {
                const uint8_t *p = q + r * qs + g0 * GROUP * bits / 8;
                const __m256i v = have == hg
                    ? _mm256_loadu_si256((const __m256i *)p)  // one 4-bit group: 16 bytes
                    : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p));
                unpack_half(have == hg ? v : _mm256_inserti128_si256(v, _mm_setzero_si128(), 1),
                            bits, lv, w[r]);
                if (lv == LOOM_Q8_Q5) high_half(q + r * qs + groups * 16 + g0 * 4, have, w[r]);
                const uint16_t *sr = sc + r * ss + g0;
                int two = sr[0];  // the half's scales (fp16), 0 for a missing second group
                if (have == 2) memcpy(&two, sr, 4);
                const __m128 s4 = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
                s[r] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), hsel);
            }
            const int64_t at_x = c * nv * 64 + half * 32, at_d = L.dv + c * 64 + half * 32;
            for (int m = 0; m < M; m++) {
                const uint8_t *xm = xq + m * xstride;
                __m256i x[4];
                for (int k = 0; k < nv; k++)
                    x[k] = _mm256_loadu_si256((const __m256i *)(xm + at_x + k * 64));
                const __m256 d = _mm256_loadu_ps((const float *)(xm + at_d));
                for (int r = 0; r < R; r++) {
                    __m256i dot = _mm256_madd_epi16(w[r][0], x[0]);
                    for (int k = 1; k < nv; k++)
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(w[r][k], x[k]));
                    acc[m * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                                     _mm256_mul_ps(s[r], d), acc[m * R + r]);
                }
            }
        }
    }
    int64_t g = 0;  // + m_w * sum x~, 8 groups at once, then the tail's (its own call: rows
    for (; g + 8 <= groups; g += 8)  // without one run the loop as before)
        add_mins(xq, M, xstride, L, mn, sc, ss, ZERO(bits, lv), R, g, 8, acc);
    if (g < groups)
        add_mins(xq, M, xstride, L, mn, sc, ss, ZERO(bits, lv), R, g, (int)(groups - g), acc);
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            const float sum = hsum8(acc[m * R + r]);
            out[m * ldy + r * rstep] = bias ? sum + bias[r * rstep] : sum;
        }
}
#endif  // VNNI_512

// Weight units u0 .. u1 - 1 (unit u's rows: n0, n0 + step, ...; u and u + (N + 1) / 2 where
// UNIT's comment says, else u UNIT .. u UNIT + UNIT - 1; fewer at the end of N) for M <= M_MAX
// quantized x rows, with their bias: M, bits (loom.h's code: 8, 5, 4 or 4 | LOOM_Q8_LEVELS) and
// R picked here, so each case runs with constants. A team's chunk of units in one call: the
// call's set-up once a chunk, not once a unit (~7% of a one-row step's samples on the 135M).
static void unit_vnni(const uint8_t *xq, int64_t M, const XLayout L, const uint8_t *w,
                      int bits, const uint16_t *scales, const uint16_t *mins,
                      const float *bias, int64_t K, int64_t u0, int64_t u1, int64_t N, float *y,
                      int64_t ldy)
{
    const int width = LOOM_Q8_WIDTH(bits);
    const int64_t groups = K / GROUP, row_bytes = K * width / 8;
    const int far = width != 8 ? M <= 2 || K >= FAR_K : FAR_8(M);  // two streams (UNIT)
    const int64_t step = far ? (N + 1) / 2 : 1;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t n0 = far ? u : u * UNIT;
        int64_t rows = 0;  // the unit's rows within N
        while (rows < UNIT && n0 + rows * step < N) rows++;
#define ROWS(m, b, lv, r, n) rows_vnni(xt, m, L.stride, L, w + (n) * row_bytes, row_bytes, b, \
                                       lv, scales + (n) * groups, \
                                       mins ? mins + (n) * groups : NULL, groups, r, step, \
                                       bias ? bias + (n) : NULL, yt + (n), ldy)
#define ROWS_R(m, b, lv) \
    if (R_OF(b, m) == UNIT && rows == UNIT) { ROWS(m, b, lv, UNIT, n0); } \
    else { for (int64_t i = 0; i < rows; i++) ROWS(m, b, lv, 1, n0 + i * step); }
#define CASES(b, lv) switch (tile) { \
    case 1: ROWS_R(1, b, lv) break; case 2: ROWS_R(2, b, lv) break; \
    case 3: ROWS_R(3, b, lv) break; default: ROWS_R(4, b, lv) break; }
        // past TILE x rows, tiles of at most TILE (the weights come again from L1)
        for (int64_t m0 = 0, tiles = (M + TILE - 1) / TILE; m0 < M;) {
            const int64_t tile = (M - m0 + tiles - 1) / tiles;
            const uint8_t *xt = xq + m0 * L.stride;
            float *yt = y + m0 * ldy;
            if (bits == 4) { CASES(4, 0) }
            else if (bits == 8) { CASES(8, 0) }
            else if (bits == LOOM_Q8_Q5) { CASES(4, LOOM_Q8_Q5) }
            else { CASES(4, LOOM_Q8_LEVELS) }
            m0 += tile;
            tiles--;
        }
    }
#undef CASES
#undef ROWS_R
#undef ROWS
}
#endif

// x: [M, K] rows ldx floats apart; w, bias, y: as loom_linear_q8_f32; scales, mins: theirs in fp16
// (IEEE half: GGUF's own, so exact for its 4- and 8-bit blocks); mins NULL: each is -ZERO(bits)
// times its scale (symmetric groups, not read). Returns 0,
// -1 on bad K or bits, -2 when the buffer for the quantized x cannot be allocated, -3 where this
// build has no VNNI kernel (loom_vnni_available).
int loom_linear_q8_vnni(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        const uint16_t *scales, const uint16_t *mins, const float *bias, int64_t N,
                        float *y, int64_t ldy, int bits, int num_threads)
{
#ifdef HAVE_VNNI
    if (loom_linear_q8_check(K, bits)) return -1;
    const XLayout L = x_layout(K, LAYOUT(bits));
    uint8_t *xq = loom_scratch(SCRATCH_X, (size_t)M_MAX * L.stride);
    if (!xq) return -2;
    const int64_t units = (N + UNIT - 1) / UNIT;
    for (int64_t m0 = 0; m0 < M; m0 += M_MAX) {
        const int64_t rows = M - m0 < M_MAX ? M - m0 : M_MAX;
        quantize_x(x + m0 * ldx, rows, K, ldx, LAYOUT(bits), xq);
        // guided chunks, as linear_q8.c's direct path (a thread the OS lends away leaves its
        // rows to the others)
#pragma omp parallel for schedule(guided, 16 / UNIT) num_threads(num_threads)
        for (int64_t u = 0; u < units; u++)
            unit_vnni(xq, rows, L, w, bits, scales, mins, bias, K, u, u + 1, N, y + m0 * ldy,
                      ldy);
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)ldx; (void)w; (void)scales; (void)mins; (void)bias;
    (void)N; (void)y; (void)ldy; (void)bits; (void)num_threads;
    return -3;
#endif
}

// The calling thread's buffer for quantized x rows of up to K values (either width): 0, or -2
// if it cannot be allocated. A team calls it in each thread before loom_linear_q8_vnni_team.
int loom_linear_q8_vnni_reserve(int64_t K)
{
#ifdef HAVE_VNNI
    const int64_t a = x_layout(K, 4).stride, b = x_layout(K, 8).stride;
    return loom_scratch(SCRATCH_X, (size_t)M_MAX * (a > b ? a : b)) ? 0 : -2;
#else
    (void)K;
    return -3;
#endif
}

// loom_linear_q8_vnni for M <= M_MAX rows (K and bits as loom_linear_q8_check takes: the caller
// checks) in a thread of a running OpenMP team, as loom_linear_q8_team: every thread calls it
// with the same arguments and `next` zeroed beforehand, after loom_linear_q8_vnni_reserve(K)
// succeeded in it; each quantizes x into its own buffer (a few microseconds) and takes guided
// chunks of units from *next. The same bits as loom_linear_q8_vnni.
void loom_linear_q8_vnni_team(const float *x, int64_t M, int64_t K, int64_t ldx,
                              const uint8_t *w, const uint16_t *scales,
                              const uint16_t *mins, const float *bias, int64_t N, float *y,
                              int64_t ldy, int bits, int64_t *next, int team)
{
#ifdef HAVE_VNNI
    const XLayout L = x_layout(K, LAYOUT(bits));
    uint8_t *xq = loom_scratch(SCRATCH_X, (size_t)M_MAX * L.stride);  // reserved: no failure
    quantize_x(x, M, K, ldx, LAYOUT(bits), xq);
    for (int64_t u0, u1; loom_take_units(next, (N + UNIT - 1) / UNIT, 16 / UNIT, team, &u0,
                                         &u1);)
        unit_vnni(xq, M, L, w, bits, scales, mins, bias, K, u0, u1, N, y, ldy);
#else  // not reached: reserve fails
    (void)x; (void)M; (void)K; (void)ldx; (void)w; (void)scales; (void)mins; (void)bias;
    (void)N; (void)y; (void)ldy; (void)bits; (void)next; (void)team;
#endif
}
