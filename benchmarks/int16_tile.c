// A GEMM tile in L1, one thread: fp32 FMAs (linear_kq_gemm.c AVX2 shape, 4 x rows by 3 weight rows)
// against int16 vpmaddwd + vpaddd summed in int32 and converted once a super-block of 256
// (TM x TN tile), what an integer K-quant GEMM past 8 rows would run. GMAC/s, best of 5 rounds.
//   clang -O3 -march=x86-64-v3 -DTM=4 -DTN=2 -o /tmp/int16_tile benchmarks/int16_tile.c && /tmp/int16_tile
// Results: docs/kquants.md ("What an integer GEMM past 8 rows would cost").
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define K 1024
#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 2
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
__attribute__((noinline)) void tile_f32(const float *x, const float *w, float *out) {
    __m256 acc[4][3];
    for (int m = 0; m < 4; m++) for (int n = 0; n < 3; n++) acc[m][n] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 W0 = _mm256_loadu_ps(w + k), W1 = _mm256_loadu_ps(w + K + k), W2 = _mm256_loadu_ps(w + 2 * K + k);
        for (int m = 0; m < 4; m++) {
            __m256 X = _mm256_loadu_ps(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(X, W0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(X, W1, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(X, W2, acc[m][2]);
        }
    }
    for (int m = 0; m < 4; m++) for (int n = 0; n < 3; n++) _mm256_storeu_ps(out + 8 * (3 * m + n), acc[m][n]);
}
__attribute__((noinline)) void tile_i16(const int16_t *x, const int16_t *w, const float *sc, float *out) {
    for (int i = 0; i < 8 * TM * TN; i++) out[i] = 0.0f;
    for (int s = 0; s < K; s += 256) {
        __m256i ia[TM][TN];
        for (int m = 0; m < TM; m++) for (int n = 0; n < TN; n++) ia[m][n] = _mm256_setzero_si256();

        for (int k = s; k < s + 256; k += 16) {
            __m256i W[TN];
            for (int n = 0; n < TN; n++) W[n] = _mm256_loadu_si256((const __m256i *)(w + n * K + k));
            for (int m = 0; m < TM; m++) {
                __m256i X = _mm256_loadu_si256((const __m256i *)(x + m * K + k));
                for (int n = 0; n < TN; n++) ia[m][n] = _mm256_add_epi32(ia[m][n], _mm256_madd_epi16(X, W[n]));
            }
        }
        const __m256 f = _mm256_set1_ps(sc[s / 256]);
        for (int m = 0; m < TM; m++) for (int n = 0; n < TN; n++)
            _mm256_storeu_ps(out + 8 * (TN * m + n), _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m][n]), f, _mm256_loadu_ps(out + 8 * (TN * m + n))));
    }
}
int main(void) {
    float *x = aligned_alloc(64, 4 * K * 4), *w = aligned_alloc(64, 3 * K * 4), out[96], sc[K / 256];
    int16_t *xi = aligned_alloc(64, 4 * K * 2), *wi = aligned_alloc(64, 3 * K * 2);
    for (int i = 0; i < 4 * K; i++) { x[i] = rand() / (float)RAND_MAX; xi[i] = rand() % 65535 - 32767; }
    for (int i = 0; i < 3 * K; i++) { w[i] = rand() / (float)RAND_MAX; wi[i] = rand() % 1890 - 945; }
    for (int i = 0; i < K / 256; i++) sc[i] = 1e-6f;
    const int reps = 200000;
    double best_f = 1e9, best_i = 1e9, sink = 0;
    for (int round = 0; round < 5; round++) {
        double t0 = now();
        for (int r = 0; r < reps; r++) { tile_f32(x, w, out); sink += out[r % 96]; }
        double t1 = now();
        for (int r = 0; r < reps; r++) { tile_i16(xi, wi, sc, out); sink += out[r % 32]; }
        double t2 = now();
        if (t1 - t0 < best_f) best_f = t1 - t0;
        if (t2 - t1 < best_i) best_i = t2 - t1;
    }
    printf("one thread, K %d in L1: fp32 FMA 4x3 tile %.1f GMAC/s; int16 vpmaddwd %dx%d tile %.1f GMAC/s [%g]\n",
           K, 12.0 * K * reps / best_f / 1e9, TM, TN, (double)TM * TN * K * reps / best_i / 1e9, sink > 0 ? 0.0 : 1.0);
    return 0;
}
