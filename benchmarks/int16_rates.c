// Issue rates on this CPU, one thread, per ns: 12 independent vpmaddwd, 12 independent vfmadd231ps,
// and 6 vpmaddwd + vpaddd pairs (what an int16 GEMM on AVX2 runs per 16 products: AVX2 has no
// vpdpwssd). Inline assembly, so the compiler neither hoists nor merges the instructions.
//   gcc -O2 -march=x86-64-v3 -o /tmp/int16_rates benchmarks/int16_rates.c && /tmp/int16_rates
// Results: docs/kquants.md ("What an integer GEMM past 8 rows would cost").
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 100000000L
#define REG(n) "%[a" #n "]"
#define MADD(n) "vpmaddwd %[s], " REG(n) ", " REG(n) "\n"        // a_n = madd(a_n, s)
#define FMA(n) "vfmadd231ps %[s], %[s], " REG(n) "\n"            // a_n += s s
#define PAIR(p, n) "vpmaddwd %[s], %[s], " REG(p) "\n vpaddd " REG(p) ", " REG(n) ", " REG(n) "\n"
#define EACH12(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11)
#define OPERANDS(v) [a0] "+x"(v##0), [a1] "+x"(v##1), [a2] "+x"(v##2), [a3] "+x"(v##3), \
    [a4] "+x"(v##4), [a5] "+x"(v##5), [a6] "+x"(v##6), [a7] "+x"(v##7), [a8] "+x"(v##8),   \
    [a9] "+x"(v##9), [a10] "+x"(v##10), [a11] "+x"(v##11)
// `count` instructions (or pairs) of `code` a pass over 12 registers of `src`'s type (named
// variables: an array's elements were stored to memory every pass), N passes: how many a ns.
#define RATE(label, count, code, src)                                                         \
    do {                                                                                      \
        __typeof__(src) v0 = src, v1 = src, v2 = src, v3 = src, v4 = src, v5 = src, v6 = src, \
                        v7 = src, v8 = src, v9 = src, v10 = src, v11 = src;                    \
        const double t0 = now();                                                              \
        for (long r = 0; r < N; r++) __asm__ volatile(code : OPERANDS(v) : [s] "x"(src));    \
        printf("%s: %.2f /ns\n", label, (double)(count) * N / (now() - t0) / 1e9);            \
    } while (0)

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(void)
{
    __m256i s = _mm256_set1_epi16(1);  // (not const: RATE copies its type)
    __m256 u = _mm256_set1_ps(1.0f);
    RATE("vpmaddwd alone", 12, EACH12(MADD), s);
    RATE("vfmadd231ps alone", 12, EACH12(FMA), u);
    // products into a6..a11, summed into a0..a5
    RATE("vpmaddwd + vpaddd pairs", 6,
         PAIR(6, 0) PAIR(7, 1) PAIR(8, 2) PAIR(9, 3) PAIR(10, 4) PAIR(11, 5), s);
    return 0;
}
