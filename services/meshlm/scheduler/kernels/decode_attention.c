/* Paged decode attention on the CPU: each row's one new query token (float32) attends over
 * its keys and values where they lie in the paged KV cache, read through its block table in
 * place (no gather into a contiguous copy first), with a two-pass softmax in float32. The
 * cache holds float32, bfloat16 or float16 (`--kv-cache-dtype`): one kernel per type,
 * meshlm_decode_attention_{f32,bf16,f16}, from decode_attention.inc. GCC 12 vectorizes no
 * _Float16 arithmetic or conversion without AVX512-FP16 (a scalar float16 kernel was 3.5x
 * slower than float32), so float16 is read as bit patterns: on CPUs with AVX-512 each vector
 * of 16 keys or values is widened by F16C as it is loaded; with F16C alone (x86-64-v3) each
 * key and value row is widened eight at a time into a float32 buffer and computed on as
 * float32; elsewhere each element is widened by integer operations as it is read.
 *
 * Layouts (strides in elements):
 *   q, out     query head h of packed row rows[r] at h * head_stride + rows[r] * row_stride,
 *              head_dim contiguous floats
 *   caches     [num_kv_heads, num_blocks, block_size, head_dim], contiguous
 *   tables     [num_rows, table_width] block ids; row r's key at position t is in block
 *              tables[r][t / block_size], offset t % block_size
 *   first/last row r attends over positions [first[r], last[r]) (last > first)
 * Query head h reads KV head h / (num_heads / num_kv_heads), as HF's repeat_kv does.
 * scratch holds scratch_per_thread floats per OpenMP thread: at least
 * (num_heads / num_kv_heads) * max(last - first); a group of at most MAX_GROUP query heads.
 *
 * Built by kernels/native.py; on x86-64 one clone per instruction set, picked at load
 * time. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

#define MAX_GROUP 64
/* Query heads of one KV head attended together, each key and value row read once for them. */
#define HEADS_AT_ONCE 4

typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t w16 __attribute__((vector_size(64)));

/* The sums of four vectors at once, into `out`: its lanes 0, 4, 8 and 12 hold those of a, b,
 * c and d. Halving twice across the pairs, then within each group of four lanes: 8 shuffles
 * and 5 adds, where four separate reductions take four times as many. (A macro: a function
 * taking 64-byte vectors by value trips GCC's ABI notes in the builds without AVX-512.) */
#define SUM4(out, a, b, c, d)                                                                 \
    do {                                                                                      \
        const m16 low8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};            \
        const m16 high8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};     \
        const v16f ab = __builtin_shuffle(a, b, low8) + __builtin_shuffle(a, b, high8);       \
        const v16f cd = __builtin_shuffle(c, d, low8) + __builtin_shuffle(c, d, high8);       \
        const m16 low4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};          \
        const m16 high4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};       \
        v16f y = __builtin_shuffle(ab, cd, low4) + __builtin_shuffle(ab, cd, high4);          \
        const m16 swap2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};             \
        y += __builtin_shuffle(y, swap2);                                                     \
        const m16 swap1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};             \
        (out) = y + __builtin_shuffle(y, swap1);                                              \
    } while (0)

/* MESHLM_PART picks one kernel's type to build (1 float32, 2 bfloat16, 3 float16): native.py
 * compiles the three parts at once, as three objects; without it the file builds them all. */
#if !defined(MESHLM_PART) || MESHLM_PART == 1
#define KV float
#define WIDEN(x) (x)
#define KVEC(i) (*(const v16f *)(k + (i)))
#define NAME(f) f##_f32
#include "decode_attention.inc"
#undef KV
#undef WIDEN
#undef KVEC
#undef NAME
#endif

#if !defined(MESHLM_PART) || MESHLM_PART == 2
#define KV uint16_t
#define WIDEN(x) widen_bf16(x)
#define KVEC(i) ((v16f)(__builtin_convertvector(*(const h16 *)(k + (i)), w16) << 16))
#define NAME(f) f##_bf16
#include "decode_attention.inc"
#undef KV
#undef WIDEN
#undef KVEC
#undef NAME
#endif

#if !defined(MESHLM_PART) || MESHLM_PART == 3
/* The float16 kernel where F16C may not be assumed: each element widened as it is read. */
#define KV uint16_t
#define WIDEN(x) widen_f16(x)
#define NAME(f) f##_f16_portable
#include "decode_attention.inc"
#undef KV
#undef WIDEN
#undef NAME

#if defined(__x86_64__)
#include <immintrin.h>

/* n float16 values (bit patterns) at src as float32 at dst, eight at a time by F16C. */
__attribute__((target("avx2,f16c,fma"))) static inline void widen_f16_row(
    float *restrict dst, const uint16_t *restrict src, int64_t n)
{
    const int64_t whole = n - n % 8;
    for (int64_t i = 0; i < whole; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (int64_t i = whole; i < n; i++) dst[i] = widen_f16(src[i]);
}

/* The float16 kernel on x86-64-v3 and later: each key and value row widened by F16C into a
 * float32 buffer (GCC 12 vectorizes no _Float16 conversion by itself), then read as float32. */
#undef CLONES
#define CLONES __attribute__((target("arch=x86-64-v3")))
#define KV uint16_t
#define WIDEN_ROW(dst, src, n) widen_f16_row(dst, src, n)
#define KVEC(i) (*(const v16f *)(kw + (i)))
#define NAME(f) f##_f16_f16c
#include "decode_attention.inc"
#undef KV
#undef WIDEN_ROW
#undef KVEC
#undef NAME

/* The float16 kernel on x86-64-v4 (AVX-512): each vector of 16 keys or values converted by
 * F16C straight from the cache into a register, as the bfloat16 kernel's keys are (no
 * float32 buffer), and the rest of the kernel in 16-wide vectors, where the x86-64-v3 one
 * runs 8 wide. */
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#undef CLONES
#define CLONES
#define KV uint16_t
#define WIDEN(x) widen_f16(x)
#define F16X16(at) ((v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at))))
#define KVEC(i) F16X16(k + (i))
#define VVEC(i) F16X16(v + (i))
#define NAME(f) f##_f16_avx512
#include "decode_attention.inc"
#undef KV
#undef WIDEN
#undef KVEC
#undef VVEC
#undef F16X16
#undef NAME
#pragma GCC pop_options

/* meshlm_decode_attention_f16 is the AVX-512 kernel or the F16C one where the CPU has them,
 * the portable one elsewhere, chosen once when the library loads. */
typedef __typeof__(meshlm_decode_attention_f16_portable) decode_attention_f16;

static decode_attention_f16 *pick_decode_attention_f16(void)
{
    __builtin_cpu_init();
    const int f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = f16c && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return avx512 ? meshlm_decode_attention_f16_avx512
           : f16c ? meshlm_decode_attention_f16_f16c
                  : meshlm_decode_attention_f16_portable;
}

decode_attention_f16 meshlm_decode_attention_f16
    __attribute__((ifunc("pick_decode_attention_f16")));
#else
__typeof__(meshlm_decode_attention_f16_portable) meshlm_decode_attention_f16
    __attribute__((alias("meshlm_decode_attention_f16_portable")));
#endif
#endif
