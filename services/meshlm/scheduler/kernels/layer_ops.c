/* The work of a decoder layer between its matmuls, float32 on the CPU, each in one call
 * instead of a handful of torch ops: the residual add fused with RMSNorm, RoPE in place, the
 * KV cache write and SiLU(gate) * up. At decode sizes every torch op costs several
 * microseconds of dispatch against well under one of arithmetic; these run in one pass over
 * the rows, on torch's OpenMP threads where a call has enough elements to share. Activations
 * are float32; the KV cache may hold bfloat16.
 *
 * Rows are tokens; every row-major array here has its rows `stride` floats apart (the
 * contiguous ones: their width). Built with decode_attention.c by kernels/native.py. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Elements below which a call stays on the calling thread: waking the others costs more. */
#define PARALLEL_MIN 65536

/* x += add (when add is not NULL), then out = weight * x / sqrt(mean(x^2) + eps), row by row
 * over [rows, hidden] contiguous arrays: HF's residual add and LlamaRMSNorm in one pass. */
CLONES
void meshlm_add_rmsnorm_f32(float *x, const float *add, const float *weight, float *out,
                            int64_t rows, int64_t hidden, float eps, int threads)
{
    #pragma omp parallel for num_threads(threads) if (rows * hidden >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        float *o = out + r * hidden;
        float squares = 0.f;
        if (add != NULL) {
            const float *a = add + r * hidden;
            #pragma omp simd reduction(+:squares)
            for (int64_t i = 0; i < hidden; i++) {
                const float v = xr[i] + a[i];
                xr[i] = v;
                squares += v * v;
            }
        } else {
            #pragma omp simd reduction(+:squares)
            for (int64_t i = 0; i < hidden; i++) squares += xr[i] * xr[i];
        }
        const float scale = 1.f / sqrtf(squares / (float)hidden + eps);
        #pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (xr[i] * scale);
    }
}

/* RoPE in place on the first `heads` heads of each row of x ([rows, stride], a head every
 * head_dim floats): HF's x * cos + rotate_half(x) * sin, with cos and signed_sin [rows,
 * head_dim] contiguous and the sign of rotate_half carried by signed_sin (its first half
 * negated). */
CLONES
void meshlm_rope_f32(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,
                     const float *cos, const float *signed_sin, int threads)
{
    const int64_t half = head_dim / 2;
    #pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * head_dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* KV cache element types (`--kv-cache-dtype`); decode_attention.c reads each. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* x rounded to the nearest bfloat16, ties to even (as torch converts). */
static inline uint16_t narrow_bf16(float x)
{
    union { float f; uint32_t u; } bits = { .f = x };
    return (uint16_t)((bits.u + 0x7FFFu + ((bits.u >> 16) & 1u)) >> 16);
}

/* x rounded to the nearest float16, ties to even (as torch converts), in integer operations:
 * past 65504 an infinity, below 2^-14 a subnormal (or zero), a NaN stays one. */
static inline uint16_t narrow_f16(float x)
{
    union { float f; uint32_t u; } bits = { .f = x };
    const uint16_t sign = (uint16_t)((bits.u >> 16) & 0x8000u);
    const uint32_t magnitude = bits.u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;                  /* NaN */
    if (magnitude >= 0x38800000u) {                                      /* >= 2^-14 */
        /* rebias the exponent, round the 13 dropped mantissa bits to even; a carry past
         * 65504 lands on the infinity's pattern */
        const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
        const uint32_t half = (rounded >> 13) - ((uint32_t)(127 - 15) << 10);
        return sign | (uint16_t)(half >= 0x7c00u ? 0x7c00u : half);
    }
    /* a subnormal float16 counts units of 2^-24: the float's mantissa (implicit bit set)
     * shifted right by 126 - its exponent, rounded to even */
    const int shift = 126 - (int)(magnitude >> 23);
    if (shift > 24) return sign;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t kept = mantissa >> shift, dropped = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    return sign | (uint16_t)(kept + (dropped > halfway || (dropped == halfway && (kept & 1u))));
}

static inline void store_head(void *cache, int64_t at, const float *src, int64_t head_dim,
                              int kind)
{
    if (kind == KV_F32) {
        memcpy((float *)cache + at, src, (size_t)head_dim * sizeof(float));
    } else if (kind == KV_F16) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int64_t i = 0; i < head_dim; i++) dst[i] = narrow_f16(src[i]);
    } else {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int64_t i = 0; i < head_dim; i++) dst[i] = narrow_bf16(src[i]);
    }
}

/* Row r's keys and values (float32) into cache slot slots[r] of each head: caches [heads,
 * head_slots, head_dim] of element `kind`; key head h of row r at k + r * k_stride +
 * h * k_head_stride (head_dim floats), values alike with their own strides. */
CLONES
void meshlm_store_kv(const float *k, int64_t k_stride, int64_t k_head_stride,
                     const float *v, int64_t v_stride, int64_t v_head_stride,
                     int64_t rows, int64_t heads, int64_t head_dim, const int64_t *slots,
                     void *k_cache, void *v_cache, int64_t head_slots, int kind)
{
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = (h * head_slots + slots[r]) * head_dim;
            store_head(k_cache, at, k + r * k_stride + h * k_head_stride, head_dim, kind);
            store_head(v_cache, at, v + r * v_stride + h * v_head_stride, head_dim, kind);
        }
    }
}

/* out = silu(gate) * up, where each row of gate_up [rows, 2 * inter] holds gate then up. */
CLONES
void meshlm_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                         int threads)
{
    #pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Each row's index of its largest element, the first where several are equal, of x [rows,
 * cols] (rows `stride` floats apart) into out [rows]: numpy's and torch's argmax, a NaN
 * counting as the largest (the first NaN's index), -0 equal to +0. Greedy sampling's,
 * straight from the logits: after a forward pass torch's `.numpy()` and numpy's argmax took
 * 60-100 µs of a step, a few in a hot loop. Sixteen lanes each keep their largest key and where it was (a
 * larger one only replaces it: the first stays), then the lanes are compared. The
 * comparisons are on integers: under -ffast-math the compiler may take every float for a
 * number. */
typedef int32_t v16i __attribute__((vector_size(64)));

static inline int is_nan_bits(uint32_t bits)
{
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

/* A float's order as a signed integer (not NaN): larger floats, larger keys; -0 as +0. */
static inline int32_t order_key(uint32_t bits)
{
    const int32_t b = bits == 0x80000000u ? 0 : (int32_t)bits;
    return b ^ ((b >> 31) & 0x7fffffff);
}

static inline __attribute__((always_inline)) int64_t argmax_row(const float *row,
                                                                 int64_t cols)
{
    const int64_t vectors = cols / 16;
    v16i best = (v16i){0} + INT32_MIN, where = {0}, nan = {0};
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t v = 0; v < vectors; v++) {
        v16i b;
        memcpy(&b, row + 16 * v, sizeof b);
        nan |= (b & 0x7fffffff) > 0x7f800000;
        const v16i sign = b >> 31;
        const v16i key = (b & ~(b == (int32_t)0x80000000)) ^ (sign & 0x7fffffff);
        const v16i larger = key > best;
        best = (key & larger) | (best & ~larger);
        where = ((lane + (int32_t)(16 * v)) & larger) | (where & ~larger);
    }
    int any_nan = 0;
    int32_t top = INT32_MIN;
    int64_t at = cols;
    for (int l = 0; l < 16 && vectors; l++) {
        any_nan |= nan[l] != 0;
        if (best[l] > top || (best[l] == top && where[l] < at)) {
            top = best[l];
            at = where[l];
        }
    }
    for (int64_t i = 16 * vectors; i < cols; i++) {  /* the tail, after every vector */
        uint32_t bits;
        memcpy(&bits, row + i, sizeof bits);
        any_nan |= is_nan_bits(bits);
        if (order_key(bits) > top) {
            top = order_key(bits);
            at = i;
        }
    }
    if (any_nan)
        for (at = 0;; at++) {
            uint32_t bits;
            memcpy(&bits, row + at, sizeof bits);
            if (is_nan_bits(bits))
                break;
        }
    return at;
}

CLONES
void meshlm_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride,
                        int64_t *out)
{
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * stride, cols);
}
