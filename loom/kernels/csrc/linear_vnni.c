// The int8 linear of linear_q8.c for decode (up to 8 rows) in integer dot products
// (AVX512-VNNI's vpdpbusd: 64 byte products a vector): y[M, N] = x[M, K] @ dequant(w)[N, K]^T +
// bias, w ~ q * scale + min in groups of 32 along K, the scales and minimums read as fp16.
//
// One stream's decode on the AVX kernel is bound partly by instructions: each weight is widened
// to fp32, scaled and multiplied on its own. Here x is quantized instead: each group of 32
// values of an x row gets one scale d (its largest magnitude / 127) and two int8 digits a and
// b, x / d = a + b / 256 (to 1/512 of d: 16 significant bits); a group's sum_k q_w[k] x[k] is
// d * (256 sum q_w a + sum q_w b) / 256 in exact integers (q_w 0..255 unsigned, the digits
// signed: vpdpbusd's operands as they are). The minimum's term takes the same x~, so an output
// is dequant(w) . x~ to fp32 rounding. One digit (llama.cpp's Q8 activations) measured 96.5%
// top-1 agreement with the fp32 reference on 1495 positions; two, 99.9%.
//
// Scales and minimums come as fp16 (GGUF stores Q4_1's and Q8_0's so: exact there), a third
// fewer bytes per 4-bit weight than fp32 ones: at one stream the weights stream from memory.
//
// A 64-byte vector of weights is a chunk: four 4-bit groups (their nibbles split into two
// vectors) or two 8-bit ones; its int32 lanes are converted to fp32 and scaled by their own
// group's s_w * d (one permute builds the pattern), summed into 16 lanes over K; the minimums'
// terms are one fma per 16 groups. Every output is summed in the same order whatever M, so a row
// computes the same bits alone as with others (but not the AVX kernel's bits).

// Built without fast math (loom/kernels/build.py).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "loom.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#include <immintrin.h>
#endif

#define GROUP 32
#define M_MAX 8       // x rows at once (more run in chunks of M_MAX)
#define PF_Q 2048     // weight bytes prefetched ahead in each row (as linear_q8.c)
#define PF_S 128      // scales and minimums prefetched ahead
#define R_OF(bits) ((bits) == 4 ? 2 : 1)  // weight rows at once

#define SCRATCH_X 3   // loom_scratch's slot for the quantized x

// 1 if this build has the VNNI kernel (the compiler targets AVX512-VNNI), 0 if not.
int loom_vnni_available(void)
{
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_VNNI
// A row is read in chunks of CG(bits) groups: four 4-bit groups (64 bytes of nibbles) or two
// 8-bit groups (64 bytes), one vector of weight bytes. The quantized x of one row, for weights of
// `bits`, C = ceil(groups / CG) chunks:
//   q   int8 [C][2][XB]  the chunk's values, digit a then digit b, each in the order the chunk's
//                        weights unpack (x_offset)
//   dv  fp32 [C][16]     each int32 lane's d / 256 (its group's; 0 past the last group)
//   sx  fp32 [G16]       sum x~ a group (groups padded to 16 with zeros)
#define CG(bits) ((bits) == 4 ? 4 : 2)
#define XB(bits) ((bits) == 4 ? 128 : 64)
typedef struct {
    int64_t chunks, g16, stride;  // stride: bytes a row
} XLayout;

static inline XLayout x_layout(int64_t K, int bits)
{
    const int64_t groups = K / GROUP, chunks = (groups + CG(bits) - 1) / CG(bits);
    const int64_t g16 = (groups + 15) / 16 * 16;
    return (XLayout){chunks, g16, chunks * 2 * XB(bits) + chunks * 64 + g16 * 4};
}

// Lane -> its group in the chunk: a 4-bit chunk's 64 bytes hold groups 0..3, 16 bytes each (the
// low nibbles values 0..15, the high ones 16..31: two vpdpbusd into the same lanes), so int32
// lanes 4h..4h + 3 sum group h; an 8-bit chunk is [g0 0..31, g1 0..31], lanes 8h..8h + 7.
static inline __m512i lane_group(int bits)
{
    return bits == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                     : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

// Byte offset in a digit's XB of value j (0..31) of the chunk's group h: a 4-bit chunk's
// low-nibble values first (64 bytes), then its high-nibble ones.
static inline int x_offset(int bits, int h, int j)
{
    return bits == 4 ? (j < 16 ? h * 16 + j : 64 + h * 16 + (j - 16)) : h * 32 + j;
}

// `rows` rows of x (ldx floats apart) into buf (x_layout(K, bits).stride bytes a row). Each
// group of 32: d = max |x| / 127, x / d = a + b / 256 + e with digits a = round(x / d) and
// b = round((x / d - a) * 256) (nearest even; b saturates at 127), |e| <= 1/512.
static void quantize_x(const float *x, int64_t rows, int64_t K, int64_t ldx, int bits,
                       uint8_t *buf)
{
    const XLayout L = x_layout(K, bits);
    const int64_t groups = K / GROUP;
    const int cg = CG(bits), xb = XB(bits), lanes = 16 / CG(bits);
    const __m512 sign = _mm512_set1_ps(-0.0f), k256 = _mm512_set1_ps(256.0f);
    for (int64_t m = 0; m < rows; m++) {
        const float *xr = x + m * ldx;
        int8_t *q = (int8_t *)(buf + m * L.stride);
        float *dv = (float *)(buf + m * L.stride + L.chunks * 2 * xb);
        float *sx = dv + L.chunks * 16;
        memset(q, 0, (size_t)(L.stride));  // q, dv and sx
        for (int64_t g = 0; g < groups; g++) {
            const __m512 v[2] = {_mm512_loadu_ps(xr + g * GROUP),
                                 _mm512_loadu_ps(xr + g * GROUP + 16)};
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_andnot_ps(sign, v[0]), _mm512_andnot_ps(sign, v[1])));
            const float d = amax / 127.0f;
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const int h = (int)(g % cg);
            int8_t *pq = q + (g / cg) * 2 * xb;
            __m512i sum = _mm512_setzero_si512();
            for (int half = 0; half < 2; half++) {
                const __m512 t = _mm512_mul_ps(v[half], inv);        // |t| <= 127
                const __m512i a = _mm512_cvtps_epi32(t);             // nearest even
                const __m512i b = _mm512_cvtps_epi32(                // t - a exact, in [-.5, .5]
                    _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(a)), k256));
                _mm_storeu_si128((__m128i *)(pq + x_offset(bits, h, 16 * half)),
                                 _mm512_cvtsepi32_epi8(a));
                const __m128i b8 = _mm512_cvtsepi32_epi8(b);         // 128 -> 127
                _mm_storeu_si128((__m128i *)(pq + xb + x_offset(bits, h, 16 * half)), b8);
                sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(a, 8),
                                                             _mm512_cvtepi8_epi32(b8)));
            }
            sx[g] = (float)_mm512_reduce_add_epi32(sum) * (d / 256.0f);
            for (int lane = h * lanes; lane < (h + 1) * lanes; lane++)
                dv[(g / cg) * 16 + lane] = d / 256.0f;
        }
    }
}

// M x rows (quantized, xq) against R weight rows from q (rows row_bytes apart, fp16 scales and
// minimums `groups` apart): out[m * ldy + r]. M, R and bits are constants at each call site.
static inline __attribute__((always_inline)) void rows_vnni(
    const uint8_t *xq, const int M, int64_t xstride, const XLayout L, const uint8_t *q,
    int64_t row_bytes, const int bits, const uint16_t *sc, const uint16_t *mn, int64_t groups,
    const int R, float *out, int64_t ldy)
{
    __m512 acc[2][M_MAX];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    const __m512i sel = lane_group(bits), nib = _mm512_set1_epi8(0x0F);
    const int cg = CG(bits), xb = XB(bits);
    for (int64_t c = 0; c < L.chunks; c++) {
        const int64_t have = groups - c * cg < cg ? groups - c * cg : cg;  // groups here
        const __mmask64 wk = have == cg ? ~0ull : (1ull << (have * GROUP * bits / 8)) - 1;
        for (int r = 0; r < R; r++) __builtin_prefetch(q + r * row_bytes + c * 64 + PF_Q);
        if (c % 8 == 0)
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(sc + r * groups + c * cg + PF_S);
                __builtin_prefetch(mn + r * groups + c * cg + PF_S);
            }
        __m512i lo[2], hi[2];
        __m512 s[2];
        for (int r = 0; r < R; r++) {
            const __m512i v = _mm512_maskz_loadu_epi8(wk, q + r * row_bytes + c * 64);
            if (bits == 4) {
                lo[r] = _mm512_and_si512(v, nib);
                hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            } else {
                lo[r] = hi[r] = v;
            }
            const __m128i sh = _mm_maskz_loadu_epi16((__mmask8)((1u << have) - 1),
                                                     sc + r * groups + c * cg);
            s[r] = _mm512_permutexvar_ps(sel, _mm512_castps128_ps512(_mm_cvtph_ps(sh)));
        }
        for (int m = 0; m < M; m++) {
            const uint8_t *xm = xq + m * xstride + c * 2 * xb;
            const __m512i a0 = _mm512_load_si512((const void *)xm);
            const __m512i b0 = _mm512_load_si512((const void *)(xm + xb));
            __m512i a1 = a0, b1 = b0;
            if (bits == 4) {
                a1 = _mm512_load_si512((const void *)(xm + 64));
                b1 = _mm512_load_si512((const void *)(xm + xb + 64));
            }
            const __m512 d =
                _mm512_load_ps((const float *)(xq + m * xstride + L.chunks * 2 * xb) + c * 16);
            for (int r = 0; r < R; r++) {
                const __m512i z = _mm512_setzero_si512();
                __m512i da = _mm512_dpbusd_epi32(z, lo[r], a0);
                __m512i db = _mm512_dpbusd_epi32(z, lo[r], b0);
                if (bits == 4) {
                    da = _mm512_dpbusd_epi32(da, hi[r], a1);
                    db = _mm512_dpbusd_epi32(db, hi[r], b1);
                }
                // 256 a + b: below 2^31 (|a|, |b| <= 127, 128 products of q <= 15 or 64 of
                // q <= 255 a lane)
                const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(da, 8), db);
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[r], d),
                                            acc[r][m]);
            }
        }
    }
    for (int64_t g = 0; g < groups; g += 16) {  // + m_w * sum x~, 16 groups at once
        const __mmask16 k = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        for (int r = 0; r < R; r++) {
            const __m512 mins = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + r * groups + g));
            for (int m = 0; m < M; m++) {
                const float *sx =
                    (const float *)(xq + m * xstride + L.chunks * (2 * xb + 64));
                acc[r][m] = _mm512_fmadd_ps(mins, _mm512_load_ps(sx + g), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Weight unit u (rows u R .. u R + R - 1, R = R_OF(bits); one at a time at the end of N) for
// M <= M_MAX quantized x rows, then their bias: M and bits picked here, so each case runs with
// constants.
static void unit_vnni(const uint8_t *xq, int64_t M, const XLayout L, const uint8_t *w,
                      int bits, const uint16_t *scales, const uint16_t *mins,
                      const float *bias, int64_t K, int64_t u, int64_t N, float *y, int64_t ldy)
{
    const int64_t groups = K / GROUP, row_bytes = K * bits / 8;
    const int R = R_OF(bits);
    const int64_t n0 = u * R, n1 = n0 + R < N ? n0 + R : N;
#define ROWS(m, b, r, n) rows_vnni(xq, m, L.stride, L, w + (n) * row_bytes, row_bytes, b, \
                                   scales + (n) * groups, mins + (n) * groups, groups, r, \
                                   y + (n), ldy)
#define CASES(b, r, n) switch (M) { \
    case 1: ROWS(1, b, r, n); break; case 2: ROWS(2, b, r, n); break; \
    case 3: ROWS(3, b, r, n); break; case 4: ROWS(4, b, r, n); break; \
    case 5: ROWS(5, b, r, n); break; case 6: ROWS(6, b, r, n); break; \
    case 7: ROWS(7, b, r, n); break; default: ROWS(8, b, r, n); break; }
    if (bits == 4 && n1 - n0 == 2) {
        CASES(4, 2, n0)
    } else {
        for (int64_t n = n0; n < n1; n++) {
            if (bits == 4) { CASES(4, 1, n) } else { CASES(8, 1, n) }
        }
    }
#undef CASES
#undef ROWS
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldy + n] += bias[n];
}
#endif

// x: [M, K] rows ldx floats apart; w, bias, y: as loom_linear_q8_f32; scales, mins: theirs in fp16
// (IEEE half: GGUF's own, so exact for its 4- and 8-bit blocks). Returns 0,
// -1 on bad K or bits, -2 when the buffer for the quantized x cannot be allocated, -3 where this
// build has no VNNI kernel (loom_vnni_available).
int loom_linear_q8_vnni(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        const uint16_t *scales, const uint16_t *mins, const float *bias, int64_t N,
                        float *y, int64_t ldy, int bits, int num_threads)
{
#ifdef HAVE_VNNI
    if (loom_linear_q8_check(K, bits)) return -1;
    const XLayout L = x_layout(K, bits);
    uint8_t *xq = loom_scratch(SCRATCH_X, (size_t)M_MAX * L.stride);
    if (!xq) return -2;
    const int R = R_OF(bits), chunk = 16 / R;
    const int64_t units = (N + R - 1) / R;
    for (int64_t m0 = 0; m0 < M; m0 += M_MAX) {
        const int64_t rows = M - m0 < M_MAX ? M - m0 : M_MAX;
        quantize_x(x + m0 * ldx, rows, K, ldx, bits, xq);
        // guided chunks, as linear_q8.c's direct path (a thread the OS lends away leaves its
        // rows to the others)
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
        for (int64_t u = 0; u < units; u++)
            unit_vnni(xq, rows, L, w, bits, scales, mins, bias, K, u, N, y + m0 * ldy, ldy);
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
    const XLayout L = x_layout(K, bits);
    uint8_t *xq = loom_scratch(SCRATCH_X, (size_t)M_MAX * L.stride);  // reserved: no failure
    quantize_x(x, M, K, ldx, bits, xq);
    const int R = R_OF(bits);
    for (int64_t u0, u1; loom_take_units(next, (N + R - 1) / R, 16 / R, team, &u0, &u1);)
        for (int64_t u = u0; u < u1; u++)
            unit_vnni(xq, M, L, w, bits, scales, mins, bias, K, u, N, y, ldy);
#else  // not reached: reserve fails
    (void)x; (void)M; (void)K; (void)ldx; (void)w; (void)scales; (void)mins; (void)bias;
    (void)N; (void)y; (void)ldy; (void)bits; (void)next; (void)team;
#endif
}
