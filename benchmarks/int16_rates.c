// Issue rates on this CPU: 12 independent vpmaddwd, 12 independent vfmadd231ps, and 6 vpmaddwd + vpaddd
// pairs (what an int16 GEMM on AVX2 runs per 16 products; AVX2 has no vpdpwssd), per ns, one thread.
//   gcc -O2 -march=x86-64-v3 -o /tmp/int16_rates benchmarks/int16_rates.c && /tmp/int16_rates
// Results: docs/kquants.md ("What an integer GEMM past 8 rows would cost").
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
// 12 independent chains a_i = madd(a_i, w) (as the earlier session's rate test), then madd feeding add
int main(void) {
    const long n = 100000000;
    double t0, t1;
    __m256i w = _mm256_set1_epi16(1);
    __m256i a0=_mm256_set1_epi16(1),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
    t0 = now();
    for (long r = 0; r < n; r++) {
        __asm__ volatile(
            "vpmaddwd %[w], %[a0], %[a0]\n vpmaddwd %[w], %[a1], %[a1]\n vpmaddwd %[w], %[a2], %[a2]\n"
            "vpmaddwd %[w], %[a3], %[a3]\n vpmaddwd %[w], %[a4], %[a4]\n vpmaddwd %[w], %[a5], %[a5]\n"
            "vpmaddwd %[w], %[a6], %[a6]\n vpmaddwd %[w], %[a7], %[a7]\n vpmaddwd %[w], %[a8], %[a8]\n"
            "vpmaddwd %[w], %[a9], %[a9]\n vpmaddwd %[w], %[a10], %[a10]\n vpmaddwd %[w], %[a11], %[a11]\n"
            : [a0]"+x"(a0),[a1]"+x"(a1),[a2]"+x"(a2),[a3]"+x"(a3),[a4]"+x"(a4),[a5]"+x"(a5),[a6]"+x"(a6),[a7]"+x"(a7),[a8]"+x"(a8),[a9]"+x"(a9),[a10]"+x"(a10),[a11]"+x"(a11) : [w]"x"(w));
    }
    t1 = now();
    printf("vpmaddwd alone: %.2f /ns\n", 12.0 * n / (t1 - t0) / 1e9);
    __m256 f0=_mm256_set1_ps(1),f1=f0,f2=f0,f3=f0,f4=f0,f5=f0,f6=f0,f7=f0,f8=f0,f9=f0,f10=f0,f11=f0, u=f0;
    t0 = now();
    for (long r = 0; r < n; r++) {
        __asm__ volatile(
            "vfmadd231ps %[u], %[u], %[a0]\n vfmadd231ps %[u], %[u], %[a1]\n vfmadd231ps %[u], %[u], %[a2]\n"
            "vfmadd231ps %[u], %[u], %[a3]\n vfmadd231ps %[u], %[u], %[a4]\n vfmadd231ps %[u], %[u], %[a5]\n"
            "vfmadd231ps %[u], %[u], %[a6]\n vfmadd231ps %[u], %[u], %[a7]\n vfmadd231ps %[u], %[u], %[a8]\n"
            "vfmadd231ps %[u], %[u], %[a9]\n vfmadd231ps %[u], %[u], %[a10]\n vfmadd231ps %[u], %[u], %[a11]\n"
            : [a0]"+x"(f0),[a1]"+x"(f1),[a2]"+x"(f2),[a3]"+x"(f3),[a4]"+x"(f4),[a5]"+x"(f5),[a6]"+x"(f6),[a7]"+x"(f7),[a8]"+x"(f8),[a9]"+x"(f9),[a10]"+x"(f10),[a11]"+x"(f11) : [u]"x"(u));
    }
    t1 = now();
    printf("vfmadd231ps alone: %.2f /ns\n", 12.0 * n / (t1 - t0) / 1e9);
    // madd + add pairs: 6 products into 6 accumulators
    t0 = now();
    for (long r = 0; r < n; r++) {
        __asm__ volatile(
            "vpmaddwd %[w], %[w], %[a6]\n vpaddd %[a6], %[a0], %[a0]\n"
            "vpmaddwd %[w], %[w], %[a7]\n vpaddd %[a7], %[a1], %[a1]\n"
            "vpmaddwd %[w], %[w], %[a8]\n vpaddd %[a8], %[a2], %[a2]\n"
            "vpmaddwd %[w], %[w], %[a9]\n vpaddd %[a9], %[a3], %[a3]\n"
            "vpmaddwd %[w], %[w], %[a10]\n vpaddd %[a10], %[a4], %[a4]\n"
            "vpmaddwd %[w], %[w], %[a11]\n vpaddd %[a11], %[a5], %[a5]\n"
            : [a0]"+x"(a0),[a1]"+x"(a1),[a2]"+x"(a2),[a3]"+x"(a3),[a4]"+x"(a4),[a5]"+x"(a5),[a6]"+x"(a6),[a7]"+x"(a7),[a8]"+x"(a8),[a9]"+x"(a9),[a10]"+x"(a10),[a11]"+x"(a11) : [w]"x"(w));
    }
    t1 = now();
    printf("vpmaddwd + vpaddd pairs: %.2f pairs /ns\n", 6.0 * n / (t1 - t0) / 1e9);
    return 0;
}
