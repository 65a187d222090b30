// fp16 <-> fp32 for the fp16 KV cache (--kv-cache-dtype float16), in plain C: clang before 15
// has no _Float16 on x86 without AVX512-FP16, and the portable builds have no F16C. Bits as
// IEEE conversions (and torch's .half() / .float()): round to nearest even, subnormals, infinity
// and NaN kept. The kernels convert 8 at a time with F16C where a build has it.

#ifndef LOOM_HALF_H
#define LOOM_HALF_H

#include <stdint.h>
#include <string.h>

static inline float loom_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | man << 13;
    } else if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
        const float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t loom_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    uint16_t o;
    if (x >= 0x47800000u) {  // past fp16's range: infinity, or a NaN (quiet)
        o = x > 0x7f800000u ? 0x7e00 : 0x7c00;
    } else if (x < 0x38800000u) {  // an fp16 subnormal or zero: the add rounds it into place
        float g;
        memcpy(&g, &x, 4);
        g += 0.5f;
        uint32_t y;
        memcpy(&y, &g, 4);
        o = (uint16_t)(y - 0x3f000000u);
    } else {  // normal: rebias, round to nearest even on the 13 bits dropped
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu + ((x >> 13) & 1u);
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)(o | sign);
}

#endif
