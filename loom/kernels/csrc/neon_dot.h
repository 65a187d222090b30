// The int8 dot product of the AArch64 kernels (linear_vnni.c, linear_kquant.c): acc's four int32
// lanes plus the sixteen products of a and b. With dot products (armv8.2-a+dotprod: the neon
// build) one `sdot`, lane i summing bytes 4i .. 4i + 3; without (armv8-a: the generic build, e.g.
// Cortex-A53 / A72) two widening multiplies and two pairwise accumulates, lane i summing bytes
// 2i, 2i + 1, 2i + 8, 2i + 9 (each product fits int16: |a|, |b| <= 128). The kernels only use
// the sum of a vector's four lanes, which is the same.

#ifndef LOOM_NEON_DOT_H
#define LOOM_NEON_DOT_H

#include <arm_neon.h>

static inline __attribute__((always_inline)) int32x4_t loom_sdot(int32x4_t acc, int8x16_t a,
                                                                 int8x16_t b)
{
#ifdef __ARM_FEATURE_DOTPROD
    return vdotq_s32(acc, a, b);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

#endif
