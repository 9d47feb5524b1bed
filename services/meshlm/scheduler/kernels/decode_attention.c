/* Paged decode attention on the CPU, float32: each row's one new query token attends over
 * its keys and values where they lie in the paged KV cache, read through its block table in
 * place (no gather into a contiguous copy first), with a two-pass softmax.
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
#define CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define CLONES
#endif

/* One query row's attention for one KV head: its `group` query heads over positions
 * [lo, lo + n), walked block by block (no division per key). `D` is a constant where the
 * caller inlines it with one (64, 128), so the loops over a head unroll into registers. */
static inline __attribute__((always_inline)) void attend_row(
    const float *const *qs, float *const *os, int64_t group, const float *keys,
    const float *values, const int64_t *table, int64_t lo, int64_t n, int64_t block_size,
    const int64_t D, float scale, float *scores)
{
    const int64_t end = lo + n;
    for (int64_t j = 0; j < group; j++) {
        const float *qv = qs[j];
        float *sj = scores + j * n;
        for (int64_t p = lo; p < end;) {
            const int64_t off = p % block_size;
            const int64_t stop = (end - p < block_size - off) ? end : p + (block_size - off);
            const float *k = keys + (table[p / block_size] * block_size + off) * D;
            for (; p + 4 <= stop; p += 4, k += 4 * D) {
                float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
                #pragma omp simd reduction(+:s0, s1, s2, s3)
                for (int64_t i = 0; i < D; i++) {
                    s0 += qv[i] * k[i];
                    s1 += qv[i] * k[D + i];
                    s2 += qv[i] * k[2 * D + i];
                    s3 += qv[i] * k[3 * D + i];
                }
                float *sp = sj + (p - lo);
                sp[0] = s0 * scale; sp[1] = s1 * scale; sp[2] = s2 * scale; sp[3] = s3 * scale;
            }
            for (; p < stop; p++, k += D) {
                float s0 = 0.f;
                #pragma omp simd reduction(+:s0)
                for (int64_t i = 0; i < D; i++) s0 += qv[i] * k[i];
                sj[p - lo] = s0 * scale;
            }
        }
        float m = -FLT_MAX;
        for (int64_t t = 0; t < n; t++) m = sj[t] > m ? sj[t] : m;
        float total = 0.f;
        #pragma omp simd reduction(+:total)
        for (int64_t t = 0; t < n; t++) {
            const float e = expf(sj[t] - m);
            sj[t] = e;
            total += e;
        }
        float acc[D];
        for (int64_t i = 0; i < D; i++) acc[i] = 0.f;
        for (int64_t p = lo; p < end;) {
            const int64_t off = p % block_size;
            const int64_t stop = (end - p < block_size - off) ? end : p + (block_size - off);
            const float *v = values + (table[p / block_size] * block_size + off) * D;
            for (; p < stop; p++, v += D) {
                const float w = sj[p - lo];
                #pragma omp simd
                for (int64_t i = 0; i < D; i++) acc[i] += w * v[i];
            }
        }
        const float inv = 1.f / total;
        float *o = os[j];
        for (int64_t i = 0; i < D; i++) o[i] = acc[i] * inv;
    }
}

CLONES
void meshlm_decode_attention_f32(
    const float *q, int64_t q_head_stride, int64_t q_row_stride,
    float *out, int64_t out_head_stride, int64_t out_row_stride,
    const int64_t *rows, const int64_t *tables, int64_t table_width,
    const int64_t *first, const int64_t *last,
    const float *k_cache, const float *v_cache, int64_t num_blocks, int64_t block_size,
    int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, float *scratch, int64_t scratch_per_thread, int threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_size = num_blocks * block_size * head_dim;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t r = 0; r < num_rows; r++) {
            const float *qs[MAX_GROUP];
            float *os[MAX_GROUP];
            for (int64_t j = 0; j < group; j++) {
                qs[j] = q + (h * group + j) * q_head_stride + rows[r] * q_row_stride;
                os[j] = out + (h * group + j) * out_head_stride + rows[r] * out_row_stride;
            }
            const float *keys = k_cache + h * head_size;
            const float *values = v_cache + h * head_size;
            const int64_t *table = tables + r * table_width;
            const int64_t lo = first[r], n = last[r] - first[r];
            float *scores = scratch + omp_get_thread_num() * scratch_per_thread;
            switch (head_dim) {
            case 64:
                attend_row(qs, os, group, keys, values, table, lo, n, block_size, 64, scale,
                           scores);
                break;
            case 128:
                attend_row(qs, os, group, keys, values, table, lo, n, block_size, 128, scale,
                           scores);
                break;
            default:
                attend_row(qs, os, group, keys, values, table, lo, n, block_size, head_dim,
                           scale, scores);
            }
        }
    }
}
