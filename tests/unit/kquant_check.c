// Loom's K-quant linears against a float64 product of their own dequantized weights (which
// tests/model/test_kquant.py checks bit for bit against the `gguf` package), for builds this
// machine cannot load into Python (the AArch64 variants, under qemu-user by
// tests/unit/test_kernel_builds.py). Random blocks of each format, N odd: the integer kernel
// (csrc/linear_kquant.c) at 1, 3, 8 and 11 rows, x in two digits a run and in one
// (LOOM_KQ_ONE_DIGIT); the kernel past 8 rows (csrc/linear_kq_gemm.c: portable fp32 on AArch64)
// at 9 and 13 rows, K past one panel chunk (1024 columns).
// Prints "ok".

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*linear_fn)(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         int fmt, const float *bias, int64_t N, float *y, int64_t ldy,
                         int num_threads);
int loom_linear_kq(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int fmt,
                   const float *bias, int64_t N, float *y, int64_t ldy, int num_threads);
int loom_linear_kq_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        int fmt, const float *bias, int64_t N, float *y, int64_t ldy,
                        int num_threads);
void loom_kq_dequant(const uint8_t *w, int fmt, int64_t K, int64_t n0, int64_t n1, float *out,
                     int64_t ldo);
int loom_kq_block_bytes(int fmt);

enum { K_MOST = 1280, N_MOST = 13, M_MOST = 13, ONE_DIGIT = 0x100 /* loom.h's */ };

// Mismatches of `linear` over rows ms[0 .. nm - 1] of random x against the float64 product;
// `digits`: 0 x as given, else the int8 digits a run of 16 the kernel quantizes x to (each
// run's d = max|x| / 127: d / 256 bounds each x's error with two, d / 2 with one).
static int check(linear_fn linear, int digits, int K, int N, const int *ms, int nm,
                 unsigned seed)
{
    static uint8_t w[N_MOST * (K_MOST / 256) * 210];
    static float wf[N_MOST * K_MOST], x[M_MOST * K_MOST], y[M_MOST * N_MOST];
    const uint16_t halves[] = {0x1419, 0x1106};  // fp16 ~1.1e-3, ~6.5e-4
    int bad = 0;
    srand(seed);
    for (int i = 0; i < ms[nm - 1] * K; i++) x[i] = (float)rand() / RAND_MAX * 2.0f - 1.0f;
    for (int fmt = 10; fmt <= 14; fmt++) {  // Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
        const int bb = loom_kq_block_bytes(fmt);
        // fp16 d (Q3_K, Q6_K: at their ends), or d and dmin (Q2_K: at its end, else first)
        const int at = fmt == 14 ? 208 : fmt == 11 ? 108 : fmt == 10 ? 80 : 0;
        for (int b = 0; b < N * K / 256; b++) {
            for (int i = 0; i < bb; i++) w[b * bb + i] = (uint8_t)rand();
            memcpy(w + b * bb + at, halves, fmt == 14 || fmt == 11 ? 2 : 4);
        }
        loom_kq_dequant(w, fmt, K, 0, N, wf, K);
        for (int t = 0; t < nm; t++) {
            const int M = ms[t];
            if (linear(x, M, K, K, w, fmt | (digits == 1 ? ONE_DIGIT : 0), NULL, N, y, N, 2))
                bad += 1000;
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) {
                    double want = 0.0, bound = 1e-30, amax = 0.0;
                    for (int k = 0; k < K; k++) {
                        if (digits && k % 16 == 0) {
                            amax = 0.0;
                            for (int i = 0; i < 16; i++)
                                amax = fmax(amax, fabs((double)x[m * K + k + i]));
                        }
                        const double p = (double)x[m * K + k] * wf[n * K + k];
                        want += p;
                        bound += fabs(wf[n * K + k]) * amax / 127 / (digits == 1 ? 2 : 256) +
                                 1e-5 * fabs(p);
                    }
                    if (fabs(y[m * N + n] - want) > bound) {
                        bad++;
                        printf("%s %d digits fmt %d M %d row %d col %d: %g vs %g\n",
                               digits ? "kq" : "kq_gemm", digits, fmt, M, m, n, y[m * N + n],
                               want);
                    }
                }
        }
    }
    return bad;
}

int main(void)
{
    const int rows_kq[] = {1, 3, 8, 11}, rows_gemm[] = {9, 13};
    const int bad = check(loom_linear_kq, 2, 512, 13, rows_kq, 4, 1) +
                    check(loom_linear_kq, 1, 512, 13, rows_kq, 4, 3) +
                    check(loom_linear_kq_gemm, 0, K_MOST, 7, rows_gemm, 2, 2);
    printf(bad ? "FAILED %d\n" : "ok\n", bad);
    return bad != 0;
}
