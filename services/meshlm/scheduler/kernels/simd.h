/* What the kernels share: their clones per instruction set and vector types (the two
 * attention kernels), and a 16-bit KV cache or weight element as float32 (those and
 * linear.c). */
#ifndef MESHLM_SIMD_H
#define MESHLM_SIMD_H

#include <stdint.h>

/* A kernel built once per instruction set, the best picked when the library loads. */
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t m16 __attribute__((vector_size(64)));

/* A bfloat16 bit pattern: the high half of a float32's. */
static inline float widen_bf16(uint16_t x)
{
    union { uint32_t u; float f; } bits = { .u = (uint32_t)x << 16 };
    return bits.f;
}

/* A float16 bit pattern, in integer operations any x86-64 vectorizes (converting a _Float16
 * needs F16C, which the portable build may not assume): a normal number's exponent is
 * rebiased, a subnormal's mantissa scaled, an infinity's or NaN's exponent kept all ones. */
static inline float widen_f16(uint16_t h)
{
    const uint32_t magnitude = h & 0x7fffu;
    uint32_t bits = (magnitude << 13) + ((uint32_t)(127 - 15) << 23);
    if (magnitude >= 0x7c00u) bits |= 0x7f800000u;
    union { uint32_t u; float f; } normal = { .u = bits }, value;
    value.f = magnitude < 0x400u ? (float)magnitude * 0x1p-24f : normal.f;
    value.u |= (uint32_t)(h & 0x8000u) << 16;
    return value.f;
}

#endif
