// Calls one of the quantized linears CALLS times on random weights of one shape, one thread:
// run under qemu-aarch64 with an instruction-counting plugin (benchmarks/aarch64_insns.sh), the
// difference between CALLS and 0 calls is the kernel's instructions. Usage:
//   aarch64_insns f32|vnni M K N bits CALLS   (the int8 grid: bits 4 or 8)
//   aarch64_insns kq M K N fmt CALLS          (K-quant blocks: ggml's type id, 12 Q4_K .. 14 Q6_K)

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../loom/kernels/csrc/loom.h"

int main(int argc, char **argv)
{
    if (argc != 7) {
        fprintf(stderr, "usage: %s f32|vnni M K N bits CALLS\n", argv[0]);
        return 2;
    }
    const int vnni = !strcmp(argv[1], "vnni"), kq = !strcmp(argv[1], "kq");
    const int64_t M = atoll(argv[2]), K = atoll(argv[3]), N = atoll(argv[4]);
    const int bits = atoi(argv[5]), calls = atoi(argv[6]), width = bits == 8 ? 8 : 4;
    const int64_t G = K / 32;
    const int64_t bytes = kq ? N * K / 256 * 210 : N * K * width / 8;  // (Q6_K's the most)
    uint8_t *w = malloc((size_t)bytes);
    float *x = malloc(sizeof(float) * (size_t)(M * K));
    float *y = malloc(sizeof(float) * (size_t)(M * N));
    float *s = malloc(sizeof(float) * (size_t)(N * G));
    float *mn = malloc(sizeof(float) * (size_t)(N * G));
    uint16_t *s16 = malloc(2 * (size_t)(N * G)), *m16 = malloc(2 * (size_t)(N * G));
    for (int64_t i = 0; i < bytes; i++) w[i] = (uint8_t)rand();
    for (int64_t i = 0; i < M * K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int64_t i = 0; i < N * G; i++) {
        s[i] = 1.0f / 1024, mn[i] = -8.0f / 1024;
        s16[i] = 0x1400, m16[i] = 0xA000;  // the same values in fp16
    }
    for (int c = 0; c < calls; c++) {
        const int rc = kq     ? loom_linear_kq(x, M, K, K, w, bits, NULL, N, y, N, 1)
                       : vnni ? loom_linear_q8_vnni(x, M, K, K, w, s16, m16, NULL, N, y, N, bits, 1)
                              : loom_linear_q8_f32(x, M, K, K, w, s, mn, NULL, N, y, N, bits, 1);
        if (rc) {
            fprintf(stderr, "kernel failed: %d\n", rc);
            return 1;
        }
    }
    printf("%g\n", calls ? (double)y[0] : 0.0);
    return 0;
}
