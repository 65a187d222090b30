// Linear layer with int8 weights for the CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T + bias.
//
// Weights are uint8 in groups of 32 along K, each group with an fp32 scale and minimum:
// w[n, k] ~ q[n, k] * scales[n, k / 32] + mins[n, k / 32]. 255 steps between a group's least and
// greatest weight hold GGUF's 4-bit groups (16 levels, 15 steps apart: 255 = 15 * 17) exactly;
// those (q below 16) can also be stored two to a byte, which halves the bytes decode reads and
// leaves every result the same. Activations and sums stay fp32.
// Decode reads weights from memory once per step, so about a quarter of fp32's bytes is the
// point; at one or two rows it is also bound by instructions per weight (loom_grid_group) and by
// how far ahead the weight streams are fetched (prefetch_rows): together 1.44x a step at one
// stream on a Xeon with AVX-512.
//
// Every output is summed in one fixed order, whatever M is: LANES lanes (16 with AVX-512, else
// 8), acc += (q * scale + min) * x over K in LANES-wide pieces, then the lanes added. Up to 8
// input rows convert and scale each weight vector in registers and use it for every row; more
// rows convert a block of weight rows once into a per-thread buffer (the same floats) and run
// every input row past it, four x rows by three weight rows per tile. So a request's result
// does not depend on its batch.

// Exact IEEE order here (loom/kernels/build.py compiles this file without fast math): the
// vector code below is explicit, and reassociation would sum the same output differently in
// the direct and the block path.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "half.h"  // loom_f16_to_f32
#include "loom.h"
#ifdef __AVX2__
#include <immintrin.h>
#include "grid_group.h"  // loom_grid_group (AVX-512), loom_q5_bytes
#endif

#define GROUP 32
#define BLOCK_BYTES (128 * 1024)  // converted block (fp32), per thread
#define X_BYTES (256 * 1024)      // x rows per pass: with the block, within a 512 KiB L2
#define M_DIRECT 8          // up to this many rows convert in registers
// The direct path prefetches each weight row PF_Q bytes ahead and its scales and minimums
// PF_S floats ahead (a row's weights, one stream per row, several rows at once: the hardware
// prefetcher alone left one row through a layer larger than the caches ~20% slower).
#define PF_Q 2048
#define PF_FAR 4096         // and into L2 this far ahead in rows of FAR_ROW bytes or more
#define FAR_ROW 1024        // (prefetcht1, as linear_vnni.c; 0.85x the 1.7B shape's layers)
#define PF_S 128
#define R_MAX 2             // weight rows at once there
#define LV4 (4 | LOOM_Q8_LEVELS)
#define Q5 LOOM_Q8_Q5
// Two 4-bit weight rows at once for one or two x rows (~1.5x, in cache and out); 8-bit rows
// stream from memory at full speed one at a time and measured slower two at a time.
#define R_OF(m, bits) ((bits) != 8 && (m) <= 2 ? 2 : 1)

// LANES floats a vector: 16 (one AVX-512 register) where the compiler targets AVX-512, else 8.
// Every path below sums in LANES lanes, so a machine's direct and block paths agree bit for bit
// (two machines of different widths agree to rounding).
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint8_t vu8 __attribute__((vector_size(LANES), aligned(1)));
typedef int32_t vi32 __attribute__((vector_size(LANES * 4)));

static inline __attribute__((always_inline)) vf loadv(const float *p) { return *(const vf *)p; }
#if LANES == 8
// q * s + m in one rounding where the CPU has FMA. Spelled out: gcc contracts the plain
// expression in some inlined contexts and not in others, and the direct and block paths must
// compute the same weights. (AVX-512: loom_grid_group, grid_group.h.)
static inline __attribute__((always_inline)) vf weight(vf q, float s, float m)
{
#if defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)q, _mm256_set1_ps(s), _mm256_set1_ps(m));
#else
    return q * s + m;
#endif
}
// LANES bytes 0..255 as floats.
static inline __attribute__((always_inline)) vf cvt_bytes(const uint8_t *p)
{
#if defined(__AVX2__)
    // gcc turns the generic form below into eight scalar conversions (measured 3x slower).
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const vu8 *)p, vi32), vf);
#endif
}
// Weights 32 g + j .. 32 g + j + LANES - 1 (j a multiple of LANES: a constant where this
// inlines) of a row q holding `bits` per weight: 8, one byte each, or 4, GGUF's order: group g's
// 16 bytes at 16 g hold its values 0..15 in their low nibbles and 16..31 in their high ones
// (4 | LOOM_Q8_LEVELS: each nibble i the value loom_iq4_q[i]; LOOM_Q8_Q5: bit i of h, the
// group's fifth bits, adds 16 to value i). The same floats either way.
static inline __attribute__((always_inline)) vf cvt_part(const uint8_t *q, const int bits,
                                                         const int64_t g, const int j,
                                                         const uint32_t h)
{
    if (bits == 8) return cvt_bytes(q + g * GROUP + j);
    const uint8_t *p = q + g * (GROUP / 2) + (j & 15);
    const int lv = bits & LOOM_Q8_LEVELS, five = bits == LOOM_Q8_Q5;
#if defined(__AVX2__)
    const __m128i v = _mm_loadl_epi64((const __m128i *)p), nib = _mm_set1_epi8(0x0F);
    __m128i i = j < 16 ? _mm_and_si128(v, nib) : _mm_and_si128(_mm_srli_epi16(v, 4), nib);
    if (five) i = _mm_or_si128(i, loom_q5_bytes(h >> j));
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        lv ? _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)loom_iq4_q), i) : i));
#else
    vf r;
    for (int i = 0; i < LANES; i++) {
        const int v = (j < 16 ? p[i] & 0x0F : p[i] >> 4) | (five ? (h >> (j + i) & 1) << 4 : 0);
        r[i] = (float)(lv ? loom_iq4_q[v] : v);
    }
    return r;
#endif
}
#endif

// Group g of a row q of K weights (`bits` a weight) as GROUP / LANES vectors of weights
// q * s + m: AVX-512's loom_grid_group, else converted LANES at a time.
static inline __attribute__((always_inline)) void group_weights(const uint8_t *q, const int bits,
                                                                int64_t K, int64_t g, float s,
                                                                float m, vf w[GROUP / LANES])
{
#if LANES == 16
    __m512 lo, hi;
    loom_grid_group(q, bits, K, g, s, m, &lo, &hi);
    w[0] = (vf)lo;
    w[1] = (vf)hi;
#else
    const uint32_t h = bits == LOOM_Q8_Q5 ? loom_q5_high(q, K, g) : 0;
    for (int j = 0; j < GROUP / LANES; j++)
        w[j] = weight(cvt_part(q, bits, g, j * LANES, h), s, m);
#endif
}

// LANES lanes to 8: lane i plus lane i + 8 (the identity at 8 lanes).
static inline __attribute__((always_inline)) v8 fold8(vf a)
{
#if LANES == 16
    return (v8)_mm256_add_ps(_mm512_castps512_ps256((__m512)a),
                             _mm512_extractf32x8_ps((__m512)a, 1));
#else
    return (v8)a;
#endif
}

static inline __attribute__((always_inline)) float hsum8(v8 a)
{
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

static inline __attribute__((always_inline)) float hsum(vf a) { return hsum8(fold8(a)); }

// hsum of n vectors into out[0..n): the same order as hsum, four at a time with horizontal adds
// ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)).
static inline __attribute__((always_inline)) void hsum_many(const vf *a, const int n, float *out)
{
#ifdef __AVX__
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128 s[4];
        for (int j = 0; j < 4; j++) {
            const __m256 f = (__m256)fold8(a[i + j]);
            s[j] = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        }
        _mm_storeu_ps(out + i, _mm_hadd_ps(_mm_hadd_ps(s[0], s[1]), _mm_hadd_ps(s[2], s[3])));
    }
    for (; i < n; i++) out[i] = hsum(a[i]);
#else
    for (int i = 0; i < n; i++) out[i] = hsum(a[i]);
#endif
}

// Before group g of R weight rows (`bits` a weight): the rows' weights PF_Q bytes ahead once a
// cache line, their scales and minimums PF_S floats ahead once 16 groups.
static inline __attribute__((always_inline)) void prefetch_rows(
    const uint8_t *q, int64_t row_bytes, const float *sc, const float *mn, int64_t groups,
    const int R, const int bits, int64_t g)
{
    // group g's first byte in a row (5-bit rows: of its nibbles)
    const int64_t at = g * GROUP * (bits == LOOM_Q8_Q5 ? 4 : LOOM_Q8_WIDTH(bits)) / 8;
    if (at % 64 == 0)
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(q + r * row_bytes + at + PF_Q);
            if (row_bytes >= FAR_ROW) __builtin_prefetch(q + r * row_bytes + at + PF_FAR, 0, 2);
        }
    if (g % 16 == 0)
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(sc + r * groups + g + PF_S);
            if (mn) __builtin_prefetch(mn + r * groups + g + PF_S);
            if (bits == LOOM_Q8_Q5)  // the fifth bits' plane, 16 groups a line
                __builtin_prefetch(q + r * row_bytes + groups * 16 + 4 * g + 64);
        }
}

// Up to M_DIRECT rows of x against R weight rows from q (rows row_bytes apart, scales and
// minimums `groups` apart), each weight vector converted and scaled in registers and used for
// every x row. M and R are constants at each call site, so the loops unroll and the M * R sums
// stay in registers. Each sum is one chain of dependent adds; R rows at once keep several
// chains in flight where M alone is too few (one x row: one chain, bound by the add's latency,
// not by memory).
static inline __attribute__((always_inline)) void rows_direct(
    const float *x, const int M, int64_t ldx, const uint8_t *q, int64_t row_bytes,
    const int bits, const float *sc, const float *mn, int64_t groups, const int R, int64_t K,
    float *out, int64_t ldy)
{
    vf acc[M_DIRECT] = {{0}};  // [r * M + m]: one flat array stays in registers
    for (int64_t g = 0; g < K / GROUP; g++) {
        prefetch_rows(q, row_bytes, sc, mn, groups, R, bits, g);
        vf w[R_MAX][GROUP / LANES];
        for (int r = 0; r < R; r++)
            group_weights(q + r * row_bytes, bits, K, g, sc[r * groups + g],
                          loom_q8_min(mn, sc, r * groups + g, bits), w[r]);
        for (int j = 0; j < GROUP / LANES; j++)
            for (int m = 0; m < M; m++) {
                const vf u = loadv(x + m * ldx + g * GROUP + j * LANES);
                for (int r = 0; r < R; r++) acc[r * M + m] += w[r][j] * u;
            }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[m * ldy + r] = hsum(acc[r * M + m]);
}

// Weight rows n .. n + R - 1 (fewer at the end of N: one at a time) for M x rows.
static inline __attribute__((always_inline)) void unit_direct(
    const float *x, const int M, int64_t ldx, const uint8_t *w, int64_t row_bytes,
    const int bits, const float *scales, const float *mins, int64_t groups, const int R,
    int64_t K, int64_t n, int64_t N, float *y, int64_t ldy)
{
    if (n + R <= N) {
        rows_direct(x, M, ldx, w + n * row_bytes, row_bytes, bits, scales + n * groups,
                    mins ? mins + n * groups : NULL, groups, R, K, y + n, ldy);
        return;
    }
    for (; n < N; n++)
        rows_direct(x, M, ldx, w + n * row_bytes, row_bytes, bits, scales + n * groups,
                    mins ? mins + n * groups : NULL, groups, 1, K, y + n, ldy);
}

// PIN keeps a loaded vector in a register: gcc otherwise folds the loads into the FMAs and
// re-loads x for every one.
#if LANES == 16
#define PIN(v) __asm__("" : "+v"(v))
#elif defined(__AVX__)
#define PIN(v) __asm__("" : "+x"(v))
#else
#define PIN(v) ((void)0)
#endif

// R (1..4, a constant at each call) x rows against three weight rows: 3R sums in registers
// (12 + 3 weight vectors + 1 x vector: the 16 AVX registers at R = 4; AVX-512 has 32).
static inline __attribute__((always_inline)) void tile_r3(
    const float *x0, const int R, int64_t ldx, const float *wb, int64_t K, float t[4][3])
{
    const float *w1b = wb + K, *w2b = w1b + K;
    vf a[4][3] = {{{0}}};
    for (int64_t k = 0; k < K; k += LANES) {
        vf w0 = loadv(wb + k), w1 = loadv(w1b + k), w2 = loadv(w2b + k);
        PIN(w0); PIN(w1); PIN(w2);
        for (int r = 0; r < R; r++) {
            vf u = loadv(x0 + r * ldx + k);
            PIN(u);
            a[r][0] += w0 * u; a[r][1] += w1 * u; a[r][2] += w2 * u;
        }
    }
    hsum_many(&a[0][0], 3 * R, &t[0][0]);
}

// One block of nb_rows weight rows from n0 (fewer at the end of N): convert it into wbuf, then x
// rows m0..m1 past it, four x rows by three weight rows a tile (padding rows computed, dropped).
static void q8_block(const float *x, int64_t m0, int64_t m1, int64_t ldx, int64_t K,
                     const uint8_t *w, const int bits, const float *scales, const float *mins,
                     const float *bias, int64_t N, int64_t n0, int64_t nb_rows, float *wbuf,
                     float *y, int64_t ldy)
{
    const int64_t groups = K / GROUP, nb = N - n0 < nb_rows ? N - n0 : nb_rows;
    const int64_t row_bytes = K * LOOM_Q8_WIDTH(bits) / 8;
    for (int64_t r = 0; r < nb; r++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = (n0 + r) * groups + g;
            group_weights(w + (n0 + r) * row_bytes, bits, K, g, scales[at],
                          loom_q8_min(mins, scales, at, bits),
                          (vf *)(wbuf + (r * groups + g) * GROUP));
        }
    const int64_t nbp = (nb + 2) / 3 * 3;
    for (int64_t i = nb * K; i < nbp * K; i++) wbuf[i] = 0.0f;
    for (int64_t m = m0; m < m1; m += 4) {
        const int64_t mr = m1 - m < 4 ? m1 - m : 4;
        for (int64_t r = 0; r < nbp; r += 3) {
            float t[4][3];
            switch (mr) {
            case 4: tile_r3(x + m * ldx, 4, ldx, wbuf + r * K, K, t); break;
            case 3: tile_r3(x + m * ldx, 3, ldx, wbuf + r * K, K, t); break;
            case 2: tile_r3(x + m * ldx, 2, ldx, wbuf + r * K, K, t); break;
            default: tile_r3(x + m * ldx, 1, ldx, wbuf + r * K, K, t); break;
            }
            const int64_t cols = nb - r < 3 ? nb - r : 3;
            for (int64_t i = 0; i < mr; i++)
                for (int64_t j = 0; j < cols; j++) y[(m + i) * ldy + n0 + r + j] = t[i][j];
        }
    }
    if (bias)
        for (int64_t m = m0; m < m1; m++)
            for (int64_t r = 0; r < nb; r++) y[m * ldy + n0 + r] += bias[n0 + r];
}

// Weight rows u R .. u R + R - 1 (R = R_OF(M, bits); fewer at the end of N) for M <= M_DIRECT
// x rows, then their bias: M and bits picked here, so each case runs with constants.
static inline __attribute__((always_inline)) void direct_unit(
    const float *x, int64_t M, int64_t ldx, const uint8_t *w, int64_t row_bytes, int bits,
    const float *scales, const float *mins, const float *bias, int64_t groups, int64_t K,
    int64_t u, int64_t N, float *y, int64_t ldy)
{
    const int R = R_OF(M, bits);
#define CASE(m, b) case m: unit_direct(x, m, ldx, w, row_bytes, b, scales, mins, groups, \
                                       R_OF(m, b), K, u * R, N, y, ldy); break;
    if (bits == 4)
        switch (M) {
        CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4)
        CASE(5, 4) CASE(6, 4) CASE(7, 4) CASE(8, 4)
        }
    else if (bits == LV4)
        switch (M) {
        CASE(1, LV4) CASE(2, LV4) CASE(3, LV4) CASE(4, LV4)
        CASE(5, LV4) CASE(6, LV4) CASE(7, LV4) CASE(8, LV4)
        }
    else if (bits == Q5)
        switch (M) {
        CASE(1, Q5) CASE(2, Q5) CASE(3, Q5) CASE(4, Q5)
        CASE(5, Q5) CASE(6, Q5) CASE(7, Q5) CASE(8, Q5)
        }
    else
        switch (M) {
        CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8)
        CASE(5, 8) CASE(6, 8) CASE(7, 8) CASE(8, 8)
        }
#undef CASE
    if (bias) {
        const int64_t n1 = u * R + R < N ? u * R + R : N;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = u * R; n < n1; n++) y[m * ldy + n] += bias[n];
    }
}

// Weight rows a block for the block paths here and in linear_bf16.c: N rows in blocks of at most
// `most` rows (at least `unit`), a multiple of `unit` each, a whole number of blocks a thread
// where that costs nothing. Returns the number of blocks, the rows of each in *rows.
int64_t loom_weight_blocks(int64_t N, int64_t most, int64_t unit, int num_threads, int64_t *rows)
{
    most = most < unit ? unit : most;
    int64_t num_blocks = (N + most - 1) / most;
    num_blocks = (num_blocks + num_threads - 1) / num_threads * num_threads;
    *rows = ((N + num_blocks - 1) / num_blocks + unit - 1) / unit * unit;
    return (N + *rows - 1) / *rows;
}

// A buffer of at least `bytes` kept per thread and grown as needed, never freed (slots
// 0..SCRATCH_SLOTS - 1: the AMX and bf16 kernels' 0..2, the VNNI kernel's 3): a fresh large
// allocation each call was mmap'd and page-faulted in again (~3% of a prefill).
#define SCRATCH_SLOTS 4
void *loom_scratch(int which, size_t bytes)
{
    static __thread void *buf[SCRATCH_SLOTS];
    static __thread size_t have[SCRATCH_SLOTS];
    if (have[which] < bytes) {
        free(buf[which]);
        have[which] = 0;
        buf[which] = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        if (!buf[which]) return NULL;
        have[which] = bytes;
    }
    return buf[which];
}

// 0 if the kernel takes rows of K weights stored `bits` a weight; -1 if not.
int loom_linear_q8_check(int64_t K, int bits)
{
    return K % GROUP != 0 || K <= 0 || (bits != 8 && bits != 4 && bits != LV4 && bits != Q5)
        ? -1 : 0;
}

// x: [M, K] rows ldx floats apart; w: [N, K] uint8 (bits 8), [N, K / 2] (bits 4, see
// cvt_part) or [N, K * 5 / 8] (LOOM_Q8_Q5); scales, mins: [N, K / 32]; bias: [N] or NULL; y:
// [M, N] rows ldy floats apart. K must be a multiple of 32. Returns 0, -1 on bad K or bits, or
// -2 when the block buffer cannot be allocated.
int loom_linear_q8_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads)
{
    if (loom_linear_q8_check(K, bits)) return -1;
    const int64_t row_bytes = K * LOOM_Q8_WIDTH(bits) / 8;
    const int64_t groups = K / GROUP;
    if (M <= M_DIRECT) {
        // R_OF(M, bits) weight rows a unit, in guided chunks, not a fixed half each: a
        // thread the OS lends to someone else (the server's event loop, a client on the same
        // cores) leaves its rows to the others instead of holding up the step.
        const int R = R_OF(M, bits), chunk = 16 / R;
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
        for (int64_t u = 0; u < (N + R - 1) / R; u++)
            direct_unit(x, M, ldx, w, row_bytes, bits, scales, mins, bias, groups, K, u, N, y,
                        ldy);
        return 0;
    }
    // Block path: each thread converts a block of weight rows (at most BLOCK_BYTES as fp32; a
    // whole number of blocks per thread) and runs a chunk of x rows past it, four x rows by
    // three weight rows a tile: the x tile stays in L1, the block and the chunk in L2.
    int64_t nb_rows;
    const int64_t num_blocks = loom_weight_blocks(N, BLOCK_BYTES / 4 / K, 3, num_threads, &nb_rows);
    // x rows per pass over the blocks: as many as fit X_BYTES.
    int64_t m_chunk = (X_BYTES / 4) / K & ~(int64_t)3;
    m_chunk = m_chunk < 16 ? 16 : m_chunk;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *wbuf = aligned_alloc(64, (nb_rows * K * sizeof(float) + 63) & ~(size_t)63);
        if (!wbuf) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
            const int64_t m1 = M - m0 < m_chunk ? M : m0 + m_chunk;
#pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < num_blocks; b++) {
                if (wbuf) q8_block(x, m0, m1, ldx, K, w, bits, scales, mins, bias, N, b * nb_rows,
                                   nb_rows, wbuf, y, ldy);
            }
        }
        free(wbuf);
    }
    return failed ? -2 : 0;
}

const int loom_linear_q8_direct_rows = M_DIRECT;

// The front the batch kernels (linear_amx.c, linear_bf16.c) share, with loom_linear_q8_f32's
// arguments: 1 where theirs runs (more than loom_linear_q8_direct_rows rows, good K and bits);
// else loom_linear_q8_f32 runs the call (its direct path, or its -1 for bad K or bits) and its
// result, 0 or negative, is the call's.
int loom_linear_q8_front(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         const float *scales, const float *mins, const float *bias, int64_t N,
                         float *y, int64_t ldy, int bits, int num_threads)
{
    if (M > M_DIRECT && !loom_linear_q8_check(K, bits)) return 1;
    return loom_linear_q8_f32(x, M, K, ldx, w, scales, mins, bias, N, y, ldy, bits, num_threads);
}

// A thread's next guided chunk of `units` work units shared through *next by a team of `team`
// (a share of what is left, at least `least`): [*u0, *u1). Returns 0 when none are left.
int loom_take_units(int64_t *next, int64_t units, int64_t least, int team, int64_t *u0,
                    int64_t *u1)
{
    int64_t at = __atomic_load_n(next, __ATOMIC_RELAXED), take;
    do {
        if (at >= units) return 0;
        take = (units - at) / (2 * team);
        take = take < least ? least : take;
    } while (!__atomic_compare_exchange_n(next, &at, at + take, 1, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    *u0 = at;
    *u1 = at + take < units ? at + take : units;
    return 1;
}

// The direct path (M <= M_DIRECT rows; K and bits as loom_linear_q8_check takes: the caller checks)
// for a thread of an OpenMP team that is already running (decoder_q8.c's one region a step):
// every thread of the team calls it with the same arguments and `next` zeroed beforehand, and
// takes guided chunks of units from *next until none are left, as the omp loop above does
// (a share of what is left, at least 16 weight rows). No fork and no join: the caller's
// barrier ends the op. The same bits as loom_linear_q8_f32.
void loom_linear_q8_team(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         const float *scales, const float *mins, const float *bias, int64_t N,
                         float *y, int64_t ldy, int bits, int64_t *next, int team)
{
    const int64_t row_bytes = K * LOOM_Q8_WIDTH(bits) / 8, groups = K / GROUP;
    const int R = R_OF(M, bits);
    for (int64_t u0, u1; loom_take_units(next, (N + R - 1) / R, 16 / R, team, &u0, &u1);)
        for (int64_t u = u0; u < u1; u++)
            direct_unit(x, M, ldx, w, row_bytes, bits, scales, mins, bias, groups, K, u, N, y,
                        ldy);
}

// One group of 32 fp32 values onto the grid above: min = least value, scale = (greatest -
// least) / 255, q = round((w - min) / scale) (half to even, as torch.round) clamped to 0..255;
// q = 0 for a constant group. Exact IEEE steps (this file is built without fast math), so the
// same values as loom.quant.int8.quantize_groups (tested). Also the int8 KV cache's writer
// (layer_ops.c).
void loom_quantize_q8_group(const float *src, uint8_t *q, float *scale, float *min)
{
#ifdef __AVX512F__
    // the scalar steps below 16 lanes at a time: IEEE division and rounding, the same values
    // (a least or greatest value of zero may keep the other zero's sign, which no q, scale or
    // dequantized value sees); ~10x fewer cycles, where the scalar loop was ~3% of a prompt's
    // step with the int8 KV cache
    const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
    const float lo = _mm512_reduce_min_ps(_mm512_min_ps(a, b));
    const float hi = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    const float s = (hi - lo) / 255.0f;
    const __m512 safe = _mm512_set1_ps(s > 0.0f ? s : 1.0f), vlo = _mm512_set1_ps(lo);
    const __m512 top = _mm512_set1_ps(255.0f), zero = _mm512_setzero_ps();
    for (int h = 0; h < 2; h++) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(h ? b : a, vlo), safe),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, zero), top);
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(v)));
    }
#elif defined(__AVX2__)
    // the same steps 8 lanes at a time (the int8 KV cache's writer on AVX2 CPUs)
    __m256 v[4];
    for (int h = 0; h < 4; h++) v[h] = _mm256_loadu_ps(src + 8 * h);
    __m256 vmin = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
    __m256 vmax = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
    __m128 m4 = _mm_min_ps(_mm256_castps256_ps128(vmin), _mm256_extractf128_ps(vmin, 1));
    __m128 x4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_min_ps(m4, _mm_movehl_ps(m4, m4));
    x4 = _mm_max_ps(x4, _mm_movehl_ps(x4, x4));
    const float lo = _mm_cvtss_f32(_mm_min_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float hi = _mm_cvtss_f32(_mm_max_ss(x4, _mm_shuffle_ps(x4, x4, 1)));
    const float s = (hi - lo) / 255.0f;
    const __m256 safe = _mm256_set1_ps(s > 0.0f ? s : 1.0f), vlo = _mm256_set1_ps(lo);
    const __m256 top = _mm256_set1_ps(255.0f), zero = _mm256_setzero_ps();
    __m256i k[4];
    for (int h = 0; h < 4; h++) {
        __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v[h], vlo), safe),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        k[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, zero), top));
    }
    // 32 int32 (each 0..255) -> 32 bytes in order: packs interleave 128-bit lanes, the permute
    // puts them back
    const __m256i w16 = _mm256_packus_epi32(k[0], k[1]), x16 = _mm256_packus_epi32(k[2], k[3]);
    const __m256i b8 = _mm256_packus_epi16(w16, x16);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float lo = src[0], hi = src[0];
    for (int j = 1; j < GROUP; j++) {
        lo = src[j] < lo ? src[j] : lo;
        hi = src[j] > hi ? src[j] : hi;
    }
    const float s = (hi - lo) / 255.0f;
    const float safe = s > 0.0f ? s : 1.0f;
    for (int j = 0; j < GROUP; j++) {
        float v = rintf((src[j] - lo) / safe);  // to nearest even
        v = v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v;
        q[j] = (uint8_t)v;
    }
#endif
    *scale = s;
    *min = lo;
}

// Fp32 weights w [N, K] onto the grid, group by group; one pass, in parallel over rows.
void loom_quantize_q8(const float *w, int64_t N, int64_t K, uint8_t *q, float *scales,
                      float *mins, int num_threads)
{
    const int64_t groups = K / GROUP;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < groups; g++)
            loom_quantize_q8_group(w + n * K + g * GROUP, q + n * K + g * GROUP,
                                   scales + n * groups + g, mins + n * groups + g);
}

// GGUF blocks [n, size] of ggml type `type` onto the grid exactly, a group of 32 weights a block
// (IQ4_XS: a group a sub-block, 8 a super-block of 256): q 16 bytes a group for Q4_0 / Q4_1 (the
// nibbles as stored) and IQ4_NL / IQ4_XS (their indices as stored: LOOM_Q8_LEVELS), Q5_0 / Q5_1's
// nibbles so and their fifth bits in a plane after each row of row_groups groups (LOOM_Q8_Q5;
// row_groups 0: 32 bytes a group, nibble + 16 x fifth bit), 32 for Q8_0 (q + 128); fp32 scales (d;
// IQ4_XS's d (ls - 32), an fp16 d times an integer below 64) and minimums (the block's m, or -zero
// x the scale: Q4_0 8, Q5_0 16, Q8_0 and the IQ4 levels 128), all exact. One pass over the file's
// bytes on num_threads threads. Returns 0, or -1 for another type or a row length that does not
// fit.
int loom_q8_blocks_grid(const uint8_t *blocks, int64_t n, int type, uint8_t *q, float *scales,
                        float *mins, int64_t row_groups, int num_threads)
{
    enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20, IQ4_XS = 23 };
    const int size = type == Q4_0 || type == IQ4_NL ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22
                     : type == Q5_1 ? 24 : type == Q8_0 ? 34 : type == IQ4_XS ? 136 : 0;
    const int five = type == Q5_0 || type == Q5_1;
    if (!size || (five && (row_groups < 0 || (row_groups && n % row_groups)))) return -1;
    const int has_m = type == Q4_1 || type == Q5_1;
    const float zero = type == Q4_0 ? 8.0f : type == Q5_0 ? 16.0f : 128.0f;
    const int width = type == Q8_0 || (five && !row_groups) ? 32 : 16;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *b = blocks + i * size;
        const float d = loom_f16_to_f32((uint16_t)(b[0] | b[1] << 8));
        if (type == IQ4_XS) {  // fp16 d; 2 bytes of the 8 scales' high 2 bits, 4 of their low
            const int high = b[2] | b[3] << 8;  // nibbles; 16 index bytes a sub-block
            for (int j = 0; j < 8; j++) {
                const int ls = (b[4 + j / 2] >> 4 * (j % 2) & 15) | (high >> 2 * j & 3) << 4;
                scales[8 * i + j] = d * (float)(ls - 32);
                mins[8 * i + j] = -zero * scales[8 * i + j];
            }
            memcpy(q + 128 * i, b + 8, 128);
            continue;
        }
        scales[i] = d;
        mins[i] = has_m ? loom_f16_to_f32((uint16_t)(b[2] | b[3] << 8)) : -zero * d;
        if (type == Q8_0) {
            uint8_t *o = q + i * 32;
            for (int j = 0; j < 32; j++) o[j] = (uint8_t)(b[2 + j] ^ 0x80);
        } else if (five && !row_groups) {  // a byte a value
            const uint8_t *qh = b + (has_m ? 4 : 2), *qs = qh + 4;
            uint32_t h;
            memcpy(&h, qh, 4);
            uint8_t *o = q + i * 32;
            for (int j = 0; j < 16; j++) {
                o[j] = (uint8_t)((qs[j] & 15) | (h >> j & 1) << 4);
                o[16 + j] = (uint8_t)((qs[j] >> 4) | (h >> (16 + j) & 1) << 4);
            }
        } else if (five) {  // qh, then the nibbles: to the row's nibbles and its plane
            const int64_t r = i / row_groups, g = i % row_groups;
            uint8_t *row = q + r * row_groups * 20;
            memcpy(row + 16 * g, b + (has_m ? 8 : 6), 16);
            memcpy(row + 16 * row_groups + 4 * g, b + (has_m ? 4 : 2), 4);
        } else {
            memcpy(q + i * width, b + (has_m ? 4 : 2), 16);
        }
    }
    return 0;
}
