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
            const int64_t lo = first[r], n = last[r] - first[r];
            const int64_t *table = tables + r * table_width;
            const float *keys = k_cache + h * head_size;
            const float *values = v_cache + h * head_size;
            float *scores = scratch + omp_get_thread_num() * scratch_per_thread;
            float maxs[MAX_GROUP], sums[MAX_GROUP];
            const float *qs[MAX_GROUP];
            float *os[MAX_GROUP];
            for (int64_t j = 0; j < group; j++) {
                qs[j] = q + (h * group + j) * q_head_stride + rows[r] * q_row_stride;
                os[j] = out + (h * group + j) * out_head_stride + rows[r] * out_row_stride;
                maxs[j] = -FLT_MAX;
            }
            for (int64_t t = 0; t < n; t++) {
                const int64_t p = lo + t;
                const float *k = keys + (table[p / block_size] * block_size + p % block_size)
                                 * head_dim;
                for (int64_t j = 0; j < group; j++) {
                    const float *qv = qs[j];
                    float s = 0.f;
                    #pragma omp simd reduction(+:s)
                    for (int64_t i = 0; i < head_dim; i++) s += qv[i] * k[i];
                    s *= scale;
                    scores[j * n + t] = s;
                    if (s > maxs[j]) maxs[j] = s;
                }
            }
            for (int64_t j = 0; j < group; j++) {
                float *sj = scores + j * n;
                const float m = maxs[j];
                float total = 0.f;
                #pragma omp simd reduction(+:total)
                for (int64_t t = 0; t < n; t++) {
                    const float e = expf(sj[t] - m);
                    sj[t] = e;
                    total += e;
                }
                sums[j] = total;
                for (int64_t i = 0; i < head_dim; i++) os[j][i] = 0.f;
            }
            for (int64_t t = 0; t < n; t++) {
                const int64_t p = lo + t;
                const float *v = values + (table[p / block_size] * block_size + p % block_size)
                                 * head_dim;
                for (int64_t j = 0; j < group; j++) {
                    float *o = os[j];
                    const float w = scores[j * n + t];
                    #pragma omp simd
                    for (int64_t i = 0; i < head_dim; i++) o[i] += w * v[i];
                }
            }
            for (int64_t j = 0; j < group; j++) {
                const float inv = 1.f / sums[j];
                for (int64_t i = 0; i < head_dim; i++) os[j][i] *= inv;
            }
        }
    }
}
