// Loom's K-quant linear past 8 rows (csrc/linear_kq_gemm.c: portable fp32 on AArch64) against a
// float64 product of its own dequantized weights, for builds this machine cannot load into
// Python (the AArch64 variants, under qemu-user by tests/unit/test_kernel_builds.py). Random
// blocks of each format, 9 and 13 rows, N odd, K past one panel chunk (1024 columns). "ok".

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int loom_linear_kq_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        int fmt, const float *bias, int64_t N, float *y, int64_t ldy,
                        int num_threads);
void loom_kq_dequant(const uint8_t *w, int fmt, int64_t K, int64_t n0, int64_t n1, float *out,
                     int64_t ldo);
int loom_kq_block_bytes(int fmt);

enum { K = 1280, N = 7, M_MOST = 13 };

int main(void)
{
    static uint8_t w[N * (K / 256) * 210];
    static float wf[N * K], x[M_MOST * K], y[M_MOST * N];
    const int ms[] = {9, 13};
    const uint16_t halves[] = {0x1419, 0x1106};  // fp16 ~1.1e-3, ~6.5e-4
    int bad = 0;
    srand(2);
    for (int i = 0; i < M_MOST * K; i++) x[i] = (float)rand() / RAND_MAX * 2.0f - 1.0f;
    for (int fmt = 12; fmt <= 14; fmt++) {
        const int bb = loom_kq_block_bytes(fmt);
        for (int b = 0; b < N * K / 256; b++) {
            for (int i = 0; i < bb; i++) w[b * bb + i] = (uint8_t)rand();
            memcpy(w + b * bb + (fmt == 14 ? 208 : 0), halves, fmt == 14 ? 2 : 4);
        }
        loom_kq_dequant(w, fmt, K, 0, N, wf, K);
        for (int t = 0; t < 2; t++) {
            const int M = ms[t];
            if (loom_linear_kq_gemm(x, M, K, K, w, fmt, NULL, N, y, N, 2)) bad += 1000;
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) {
                    double want = 0.0, bound = 1e-30;
                    for (int k = 0; k < K; k++) {
                        const double p = (double)x[m * K + k] * wf[n * K + k];
                        want += p;
                        bound += 1e-5 * fabs(p);  // fp32 sums of exact products
                    }
                    if (fabs(y[m * N + n] - want) > bound) {
                        bad++;
                        printf("fmt %d M %d row %d col %d: %g vs %g\n", fmt, M, m, n,
                               y[m * N + n], want);
                    }
                }
        }
    }
    printf(bad ? "FAILED %d\n" : "ok\n", bad);
    return bad != 0;
}
