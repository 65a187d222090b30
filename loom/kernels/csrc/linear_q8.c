// Linear layer with int8 weights for the CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T + bias.
//
// Weights are uint8 in groups of 32 along K, each group with an fp32 scale and minimum:
// w[n, k] ~ q[n, k] * scales[n, k / 32] + mins[n, k / 32]. 255 steps between a group's least and
// greatest weight hold GGUF's 4-bit groups (16 levels, 15 steps apart: 255 = 15 * 17) exactly.
// Activations and sums stay fp32.
// Decode reads weights from memory once per step, so about a quarter of fp32's bytes is the
// point.
//
// Every output is summed in one fixed order, whatever M is: 8 lanes, acc += (q * scale + min) * x
// over K in 8-wide pieces, then the lanes added. Up to 8 input rows convert and scale each
// weight vector in registers and use it for every row; more rows convert a block of weight rows
// once into a per-thread buffer (the same floats) and reuse it for 32 input rows at a time,
// four x rows by two weight rows per tile. So a request's result does not depend on its batch.

// Exact IEEE order here (the library is built with -ffast-math for the attention's expf): the
// vector code below is explicit, and reassociation would sum the same output differently in
// the direct and the block path.
#pragma GCC optimize("no-fast-math")

#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define GROUP 32
#define BLOCK_FLOATS 16384  // converted block: rows * K floats (64 KiB)
#define M_TILE 32           // input rows per pass over a converted block
#define M_DIRECT 8          // up to this many rows convert in registers

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint8_t v8u8 __attribute__((vector_size(8), aligned(1)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8 load8(const float *p) { return *(const v8 *)p; }
static inline __attribute__((always_inline)) v8 cvt8(const uint8_t *p)
{
#ifdef __AVX2__
    // gcc turns the generic form below into eight scalar conversions (measured 3x slower).
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const v8u8 *)p, v8i32), v8);
#endif
}
static inline __attribute__((always_inline)) float hsum(v8 a)
{
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Up to M_DIRECT rows of x against one weight row q (uint8), each weight vector converted and
// scaled in registers and used for every x row. M is a constant at each call site, so the
// loops unroll and the M sums stay in registers.
static inline __attribute__((always_inline)) void row_direct(
    const float *x, const int M, int64_t ldx, const uint8_t *q, const float *sc,
    const float *mn, int64_t K, float *out, int64_t ldy)
{
    v8 acc[M_DIRECT] = {{0}};
    for (int64_t k = 0; k < K; k += 8) {
        const v8 w = cvt8(q + k) * sc[k / GROUP] + mn[k / GROUP];
        for (int m = 0; m < M; m++) acc[m] += w * load8(x + m * ldx + k);
    }
    for (int m = 0; m < M; m++) out[m * ldy] = hsum(acc[m]);
}

// Four weight rows (converted and scaled, wb) against two rows of x: eight sums, each in the
// same order as row_direct's.
static inline __attribute__((always_inline)) void tile_4x2(
    const float *x0, const float *x1, const float *wb, int64_t K, float *y0, float *y1)
{
    const float *w1b = wb + K, *w2b = w1b + K, *w3b = w2b + K;
    v8 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    for (int64_t k = 0; k < K; k += 8) {
        const v8 w0 = load8(wb + k), w1 = load8(w1b + k), w2 = load8(w2b + k), w3 = load8(w3b + k);
        const v8 u = load8(x0 + k), v = load8(x1 + k);
        a00 += w0 * u; a01 += w1 * u; a02 += w2 * u; a03 += w3 * u;
        a10 += w0 * v; a11 += w1 * v; a12 += w2 * v; a13 += w3 * v;
    }
    y0[0] = hsum(a00); y0[1] = hsum(a01); y0[2] = hsum(a02); y0[3] = hsum(a03);
    y1[0] = hsum(a10); y1[1] = hsum(a11); y1[2] = hsum(a12); y1[3] = hsum(a13);
}

// Two weight rows against four x rows: eight sums, each in the same order as row_direct's.
// PIN keeps each loaded vector in a register: gcc otherwise folded the loads into the FMAs,
// re-loading x for every one (12 loads per 8 FMAs in tile_4x2). 1.2-1.4x tile_4x2's speed
// from 16 rows up, measured over 30 layers streamed from memory.
#ifdef __AVX__
#define PIN(v) __asm__("" : "+x"(v))
#else
#define PIN(v) ((void)0)
#endif
static inline __attribute__((always_inline)) void tile_2x4(
    const float *x0, int64_t ldx, const float *wb, int64_t K, float *y0, int64_t ldy)
{
    const float *w1b = wb + K, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
    for (int64_t k = 0; k < K; k += 8) {
        v8 w0 = load8(wb + k), w1 = load8(w1b + k);
        v8 u0 = load8(x0 + k), u1 = load8(x1 + k), u2 = load8(x2 + k), u3 = load8(x3 + k);
        PIN(w0); PIN(w1); PIN(u0); PIN(u1); PIN(u2); PIN(u3);
        a00 += w0 * u0; a01 += w1 * u0;
        a10 += w0 * u1; a11 += w1 * u1;
        a20 += w0 * u2; a21 += w1 * u2;
        a30 += w0 * u3; a31 += w1 * u3;
    }
    y0[0] = hsum(a00); y0[1] = hsum(a01);
    y0[ldy] = hsum(a10); y0[ldy + 1] = hsum(a11);
    y0[2 * ldy] = hsum(a20); y0[2 * ldy + 1] = hsum(a21);
    y0[3 * ldy] = hsum(a30); y0[3 * ldy + 1] = hsum(a31);
}

// x: [M, K] rows ldx floats apart; w: [N, K] uint8; scales, mins: [N, K / 32]; bias: [N] or NULL;
// y: [M, N] rows ldy floats apart. K must be a multiple of 32. Returns 0, or -1 on bad K.
int loom_linear_q8_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int num_threads)
{
    if (K % GROUP != 0 || K <= 0) return -1;
    const int64_t groups = K / GROUP;
    if (M <= M_DIRECT) {
        // One weight row per call: two or four rows at once in one thread measured 2.5x
        // slower, streamed from memory, than one.
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t n = 0; n < N; n++)
            switch (M) {
#define CASE(m) case m: row_direct(x, m, ldx, w + n * K, scales + n * groups, \
                                       mins + n * groups, K, y + n, ldy); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
            }
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = 0; n < N; n++) y[m * ldy + n] += bias[n];
        return 0;
    }
    int64_t rows = BLOCK_FLOATS / K;
    rows = rows < 4 ? 4 : rows > 16 ? 16 : rows;
    rows &= ~(int64_t)3;
    const int64_t num_blocks = (N + rows - 1) / rows;
#pragma omp parallel num_threads(num_threads)
    {
        float *wbuf = __builtin_alloca(rows * K * sizeof(float) + 64);
        wbuf = (float *)(((uintptr_t)wbuf + 63) & ~(uintptr_t)63);
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
            const int64_t m1 = M - m0 < M_TILE ? M : m0 + M_TILE;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_blocks; b++) {
                const int64_t n0 = b * rows, nb = N - n0 < rows ? N - n0 : rows;
                for (int64_t i = 0; i < nb * K; i += 8)
                    *(v8 *)(wbuf + i) = cvt8(w + n0 * K + i) * scales[n0 * groups + i / GROUP]
                                        + mins[n0 * groups + i / GROUP];
                for (int64_t i = nb * K; i < ((nb + 3) & ~(int64_t)3) * K; i++) wbuf[i] = 0.0f;
                // Rows past nb in the last block (zeroed above), and a missing second x row,
                // are computed and dropped: every kept sum comes from a tile, in one order.
                int64_t m = m0;
                for (; m + 4 <= m1; m += 4) {
                    float t[4][16];  // a block has at most 16 rows
                    for (int64_t r = 0; r < nb; r += 2)
                        tile_2x4(x + m * ldx, ldx, wbuf + r * K, K, &t[0][r], 16);
                    for (int64_t i = 0; i < 4; i++)
                        for (int64_t j = 0; j < nb; j++) y[(m + i) * ldy + n0 + j] = t[i][j];
                }
                for (; m < m1; m += 2) {
                    const float *x0 = x + m * ldx, *x1 = m + 1 < m1 ? x0 + ldx : x0;
                    for (int64_t r = 0; r < nb; r += 4) {
                        float t0[4], t1[4];
                        tile_4x2(x0, x1, wbuf + r * K, K, t0, t1);
                        for (int64_t j = 0; j < 4 && r + j < nb; j++) {
                            y[m * ldy + n0 + r + j] = t0[j];
                            if (m + 1 < m1) y[(m + 1) * ldy + n0 + r + j] = t1[j];
                        }
                    }
                }
                if (bias)
                    for (int64_t m = m0; m < m1; m++)
                        for (int64_t r = 0; r < nb; r++) y[m * ldy + n0 + r] += bias[n0 + r];
            }
        }
    }
    return 0;
}

// The grid above from fp32 weights w [N, K]: per group of 32, min = least weight,
// scale = (greatest - least) / 255, q = round((w - min) / scale) (half to even, as torch.round)
// clamped to 0..255; q = 0 for a constant group. One pass, in parallel over rows; the same
// bits as loom.quant.int8.quantize_groups (tested).
void loom_quantize_q8(const float *w, int64_t N, int64_t K, uint8_t *q, float *scales,
                      float *mins, int num_threads)
{
    const int64_t groups = K / GROUP;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < groups; g++) {
            const float *src = w + n * K + g * GROUP;
            float lo = src[0], hi = src[0];
            for (int j = 1; j < GROUP; j++) {
                lo = src[j] < lo ? src[j] : lo;
                hi = src[j] > hi ? src[j] : hi;
            }
            const float scale = (hi - lo) / 255.0f;
            const float safe = scale > 0.0f ? scale : 1.0f;
            uint8_t *dst = q + n * K + g * GROUP;
            for (int j = 0; j < GROUP; j++) {
                float v = __builtin_roundevenf((src[j] - lo) / safe);
                v = v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v;
                dst[j] = (uint8_t)v;
            }
            scales[n * groups + g] = scale;
            mins[n * groups + g] = lo;
        }
}
