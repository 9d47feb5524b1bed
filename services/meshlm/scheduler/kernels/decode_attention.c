/* Paged decode attention on the CPU: each row's one new query token (float32) attends over
 * its keys and values where they lie in the paged KV cache, read through its block table in
 * place (no gather into a contiguous copy first), with a two-pass softmax in float32. The
 * cache holds float32 or bfloat16 (`--kv-cache-dtype`): one kernel per type,
 * meshlm_decode_attention_{f32,bf16}, from decode_attention.inc. (Not float16: GCC 12
 * vectorizes no _Float16 load without AVX512-FP16, and the scalar kernel was 3.5x slower.)
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

#define MAX_GROUP 64

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

static inline float widen_bf16(uint16_t x)
{
    union { uint32_t u; float f; } bits = { .u = (uint32_t)x << 16 };
    return bits.f;
}

#define KV float
#define WIDEN(x) (x)
#define NAME(f) f##_f32
#include "decode_attention.inc"
#undef KV
#undef WIDEN
#undef NAME

#define KV uint16_t
#define WIDEN(x) widen_bf16(x)
#define NAME(f) f##_bf16
#include "decode_attention.inc"
#undef KV
#undef WIDEN
#undef NAME
