// A few of Loom's kernels against plain loops (the hybrids' mixer steps: their chunkwise forms
// against token by token), for builds this machine cannot load into Python (the AArch64
// variants, run under qemu-user by tests/unit/test_kernel_builds.py). Prints "ok".

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../../loom/kernels/csrc/loom.h"  // (the ABI: its prototypes)

static float rnd(void) { return (float)rand() / RAND_MAX * 2.0f - 1.0f; }

static int close_to(double got, double want, double tol)
{
    return fabs(got - want) <= tol * (1.0 + fabs(want));
}

// loom_linear_q8_f32 on weights w stored `bits` a weight, whose values are v [N, K], for one
// x row (the direct path) and all M (the block path), against float64 sums: the misses.
static int check_packed(const float *x, int M, int K, int N, const uint8_t *w, int bits,
                        const int *v, const float *scales, const float *mins, float *y)
{
    int bad = 0;
    for (int rows = 1; rows <= M; rows += M - 1) {
        if (loom_linear_q8_f32(x, rows, K, K, w, scales, mins, NULL, N, y, N, bits, 2))
            bad += 1000;
        for (int m = 0; m < rows; m++)
            for (int n = 0; n < N; n++) {
                double want = 0.0;
                for (int k = 0; k < K; k++)
                    want += (double)x[m * K + k] *
                            ((double)v[n * K + k] * scales[n * K / 32 + k / 32] +
                             mins[n * K / 32 + k / 32]);
                bad += !close_to(y[m * N + n], want, 1e-4);
            }
    }
    return bad;
}

static float *rnd_array(int64_t n, float scale)
{
    float *a = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) a[i] = scale * rnd();
    return a;
}

static int close_arrays(const float *a, const float *b, int64_t n, double tol)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !close_to(a[i], b[i], tol);
    return bad;
}

// Group g of a row of K weights (q: its 32 values) as `bits` stores it (loom.h): a byte each
// (8), two a byte in GGUF's nibble order (4, 4 | LOOM_Q8_LEVELS: level indices), or those
// nibbles with each group's fifth bits as a 32-bit word past the row's K / 2 bytes (LOOM_Q8_Q5).
static void pack_group(const uint8_t *q, int bits, int K, int g, uint8_t *row)
{
    if (bits == 8) {
        memcpy(row + 32 * g, q, 32);
        return;
    }
    for (int j = 0; j < 16; j++) row[16 * g + j] = (uint8_t)((q[j] & 15) | (q[j + 16] & 15) << 4);
    if (bits != LOOM_Q8_Q5) return;
    uint32_t h = 0;
    for (int j = 0; j < 32; j++) h |= (uint32_t)(q[j] >> 4 & 1) << j;
    for (int b = 0; b < 4; b++) row[K / 2 + 4 * g + b] = (uint8_t)(h >> 8 * b);
}

// Gated DeltaNet's and Mamba2's steps on a prompt of 21 rows (two chunks of 8 and a part one)
// from nonzero states: the chunkwise forms (chunked 1) against token by token (chunked 0),
// outputs and states; heads 24 wide (a vector and a part one in every build's lanes).
static int check_mixers(void)
{
    enum { T = 21, KH = 2, VH = 4, DK = 16, DV = 24, W = 4 };
    int bad = 0;
    const int64_t slot = 0, cd = 2 * KH * DK + VH * DV, pn = cd + VH * DV + 2 * VH;
    float *proj = rnd_array(T * pn, 1.0f), *conv_w = rnd_array(cd * W, 0.5f);
    float *a_log = rnd_array(VH, 0.5f), *dt_bias = rnd_array(VH, 0.5f);
    for (int h = 0; h < VH; h++) dt_bias[h] -= 4.0f;  // (slow decays: S_0's terms count)
    float *norm_w = rnd_array(VH * DV, 1.0f), *conv0 = rnd_array(cd * (W - 1), 0.3f);
    float *ssm0 = rnd_array(VH * DK * DV, 0.3f), *conv[2], *ssm[2], *out[2];
    for (int c = 0; c < 2; c++) {
        conv[c] = malloc(sizeof(float) * cd * (W - 1));
        ssm[c] = malloc(sizeof(float) * VH * DK * DV);
        out[c] = malloc(sizeof(float) * T * VH * DV);
        memcpy(conv[c], conv0, sizeof(float) * cd * (W - 1));
        memcpy(ssm[c], ssm0, sizeof(float) * VH * DK * DV);
        const int64_t starts[2] = {0, T};
        bad += loom_gdn_decode_f32(proj, pn, &slot, 1, starts, NULL, conv[c], conv_w, ssm[c],
                                   a_log, dt_bias, norm_w, KH, VH, DK, DV, W, 0, c, 1e-6f,
                                   out[c], 2) != 0;
    }
    bad += close_arrays(out[1], out[0], T * VH * DV, 1e-4);
    bad += close_arrays(ssm[1], ssm[0], VH * DK * DV, 1e-4);
    bad += close_arrays(conv[1], conv[0], cd * (W - 1), 0.0);
    // Mamba2: heads of 24, groups of two heads sharing B and C of 20, a conv bias
    enum { H = 6, P = 24, G = 3, N = 20 };
    const int64_t inner = H * P, mcd = inner + 2 * G * N, mpn = inner + mcd + H;
    float *mproj = rnd_array(T * mpn, 1.0f), *mconv_w = rnd_array(mcd * W, 0.5f);
    float *conv_b = rnd_array(mcd, 0.5f), *m_dt_bias = rnd_array(H, 0.5f);
    for (int h = 0; h < H; h++) m_dt_bias[h] -= 4.0f;
    float *m_a_log = rnd_array(H, 0.5f), *d = rnd_array(H, 1.0f);
    float *m_norm_w = rnd_array(inner, 1.0f);
    float *mconv0 = rnd_array(mcd * (W - 1), 0.3f), *mssm0 = rnd_array(H * N * P, 0.3f);
    for (int c = 0; c < 2; c++) {
        conv[c] = realloc(conv[c], sizeof(float) * mcd * (W - 1));
        ssm[c] = realloc(ssm[c], sizeof(float) * H * N * P);
        out[c] = realloc(out[c], sizeof(float) * T * inner);
        memcpy(conv[c], mconv0, sizeof(float) * mcd * (W - 1));
        memcpy(ssm[c], mssm0, sizeof(float) * H * N * P);
        const int64_t starts[2] = {0, T};
        bad += loom_mamba2_decode_f32(mproj, mpn, &slot, 1, starts, NULL, conv[c], mconv_w,
                                      conv_b, ssm[c], m_dt_bias, m_a_log, d, m_norm_w, H, P, G,
                                      N, W, 1, c, 1e-5f, 0.0f, INFINITY, out[c], 2) != 0;
    }
    bad += close_arrays(out[1], out[0], T * inner, 1e-4);
    bad += close_arrays(ssm[1], ssm[0], H * N * P, 1e-4);
    return bad;
}

// A normal fp16 number's bits with exponent field e (value 2^(e - 15) (1 + mant / 1024)), and
// its value: positive, or either sign (`signs`).
static uint16_t rnd_half(int e_lo, int e_hi, int signs, float *value)
{
    const int e = e_lo + rand() % (e_hi - e_lo + 1), mant = rand() % 1024;
    const int sign = signs ? rand() % 2 : 0;
    *value = (sign ? -1.0f : 1.0f) * ldexpf(1.0f + mant / 1024.0f, e - 15);
    return (uint16_t)(sign << 15 | e << 10 | mant);
}

// loom_linear_q8_vnni (the integer kernel of up to 8 rows, where the build has one) against
// float64 sums of the weights' values times x as the kernel quantizes it: each group of 32 to
// d (max |x| / 127) times two int8 digits, X = 256 a + b. Every stored form (8-bit, 4-bit,
// IQ4 levels, 5-bit), fp16 minimums or none (symmetric: -zero x scale), with a bias or not,
// rows ending in a whole quad of groups or 1 to 3 past it, 1 to 11 x rows, an odd N (the far
// pairs' last row alone).
static int check_vnni(void)
{
    enum { KMAX = 32 * 9, N = 5, MMAX = 11 };
    static const int forms[4] = {8, 4, 4 | LOOM_Q8_LEVELS, LOOM_Q8_Q5};
    static float x[MMAX * KMAX], xt[MMAX * KMAX], y[MMAX * N], bias[N], sf[N * KMAX / 32],
        mf[N * KMAX / 32];
    static uint16_t sh[N * KMAX / 32], mh[N * KMAX / 32];
    static uint8_t w[N * KMAX];
    static int v[N * KMAX];
    int bad = 0;
    for (int i = 0; i < N; i++) bias[i] = rnd();
    for (int K = 32 * 4; K <= KMAX; K += 32 * 3) {  // 4, 7 and 9 groups
        const int G = K / 32;
        for (int i = 0; i < MMAX * K; i++) x[i] = 4.0f * rnd();
        for (int i = 0; i < K; i++) x[i] = 0.0f;  // row 0's groups all zero: d 0
        for (int i = 0; i < MMAX * G; i++) {  // x~, as quantize_x
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * i + j]));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int j = 0; j < 32; j++) {
                const float t = x[32 * i + j] * inv, a = rintf(t);
                const float b = fminf(fmaxf(rintf((t - a) * 256.0f), -128.0f), 127.0f);
                xt[32 * i + j] = (d / 256.0f) * (256.0f * a + b);
            }
        }
        for (int f = 0; f < 4; f++) {
            const int bits = forms[f], zero = loom_q8_zero(bits);
            for (int n = 0; n < N; n++)
                for (int g = 0; g < G; g++) {
                    uint8_t q[32];
                    for (int j = 0; j < 32; j++) {
                        q[j] = (uint8_t)(rand() % (1 << LOOM_Q8_WIDTH(bits)));
                        v[n * K + 32 * g + j] = bits & LOOM_Q8_LEVELS ? loom_iq4_q[q[j]] : q[j];
                    }
                    pack_group(q, bits, K, g, w + n * K * LOOM_Q8_WIDTH(bits) / 8);
                    sh[n * G + g] = rnd_half(3, 6, 0, &sf[n * G + g]);  // s 2^-12 .. 2^-8
                    mh[n * G + g] = rnd_half(6, 10, 1, &mf[n * G + g]);
                }
            for (int sym = 0; sym < 2; sym++)
                for (int M = 1; M <= MMAX; M += M < 8 ? 1 : 3) {
                    const float *b = M % 2 ? bias : NULL;
                    if (loom_linear_q8_vnni(x, M, K, K, w, sh, sym ? NULL : mh, b, N, y, N, bits,
                                            2))
                        bad += 1000;
                    for (int m = 0; m < M; m++)
                        for (int n = 0; n < N; n++) {
                            double want = b ? b[n] : 0.0, mag = 0.0;
                            for (int k = 0; k < K; k++) {
                                const int at = n * G + k / 32;
                                const double wv = (double)v[n * K + k] * sf[at] +
                                                  (sym ? -(double)zero * sf[at] : mf[at]);
                                want += wv * xt[m * K + k];
                                mag += fabs(wv * xt[m * K + k]);
                            }
                            bad += fabs(y[m * N + n] - want) > 1e-5 * mag + 1e-6;
                        }
                }
        }
    }
    return bad;
}

int main(void)
{
    enum { M = 11, K = 96, N = 7, D = 40 };
    static float w[N * K], x[M * K], y[M * N], scales[N * K / 32], mins[N * K / 32];
    static uint8_t q[N * K];
    int bad = 0;
    for (int i = 0; i < N * K; i++) w[i] = rnd();
    for (int i = 0; i < M * K; i++) x[i] = rnd();
    loom_quantize_q8(w, N, K, q, scales, mins, 2);
    for (int n = 0; n < N; n++)
        for (int g = 0; g < K / 32; g++) {
            const float lo = mins[n * K / 32 + g], s = scales[n * K / 32 + g];
            for (int j = 0; j < 32; j++) {  // every weight within half a step of its value
                const float v = q[n * K + g * 32 + j] * s + lo;
                bad += fabsf(v - w[n * K + g * 32 + j]) > 0.5001f * s + 1e-6f;
            }
        }
    static int v[N * K];  // the values the kernel should read: a byte each, then packed forms
    for (int i = 0; i < N * K; i++) v[i] = q[i];
    bad += check_packed(x, M, K, N, q, 8, v, scales, mins, y);
    // IQ4_NL level indices two a byte (bits 4 | LOOM_Q8_LEVELS): q's low nibbles, each standing
    // for its level + 128; the 5-bit form (LOOM_Q8_Q5): q's low five bits
    static uint8_t q4[N * K / 2], q5[N * K * 5 / 8];
    for (int n = 0; n < N; n++)
        for (int g = 0; g < K / 32; g++) {
            pack_group(q + n * K + g * 32, 4, K, g, q4 + n * K / 2);
            pack_group(q + n * K + g * 32, LOOM_Q8_Q5, K, g, q5 + n * K * 5 / 8);
        }
    for (int i = 0; i < N * K; i++) v[i] = loom_iq4_q[q[i] & 15];
    bad += check_packed(x, M, K, N, q4, 4 | LOOM_Q8_LEVELS, v, scales, mins, y);
    for (int i = 0; i < N * K; i++) v[i] = q[i] & 31;
    bad += check_packed(x, M, K, N, q5, LOOM_Q8_Q5, v, scales, mins, y);
    static float gu[3 * 2 * D], out[3 * D];
    for (int i = 0; i < 3 * 2 * D; i++) gu[i] = 8.0f * rnd();
    loom_silu_mul_f32(gu, out, 3, D, 2);
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < D; i++) {
            const double g = gu[t * 2 * D + i], u = gu[t * 2 * D + D + i];
            bad += !close_to(out[t * D + i], g / (1.0 + exp(-g)) * u, 1e-5);
        }
    static float h[2 * D], r[2 * D], wn[D], sum[2 * D];
    for (int i = 0; i < 2 * D; i++) h[i] = rnd(), r[i] = rnd(), sum[i] = h[i] + r[i];
    for (int i = 0; i < D; i++) wn[i] = rnd();
    loom_add_rms_norm_f32(h, r, wn, 2, D, 1e-5f, 2);
    for (int t = 0; t < 2; t++) {
        double ss = 0.0;
        for (int i = 0; i < D; i++) ss += (double)r[t * D + i] * r[t * D + i];
        const double inv = 1.0 / sqrt(ss / D + 1e-5);
        for (int i = 0; i < D; i++) {
            bad += r[t * D + i] != sum[t * D + i];  // residual += x
            bad += !close_to(h[t * D + i], wn[i] * r[t * D + i] * inv, 1e-5);
        }
    }
    bad += check_mixers();
    bad += loom_vnni_available() ? check_vnni()
                                 : loom_linear_q8_vnni(x, 1, K, K, q, NULL, NULL, NULL, N, y, N,
                                                       8, 1) != -3;
    printf(bad ? "FAILED: %d\n" : "ok\n", bad);
    return bad != 0;
}
