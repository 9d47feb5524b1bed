/* Causal attention of prompt chunks over the paged KV cache, as matrix products: the
 * decode kernel (decode_attention.c) takes one query row at a time and reduces every
 * query-key product across a vector, which holds a chunk of a few hundred tokens to about 50
 * GFLOP/s on 2 threads. Here, for one KV head and one chunk, the keys are first laid out
 * transposed, 16 positions to a vector (each cache block [16, D] becomes [D, 16]); then
 * tiles of 16 query vectors (16 / G tokens, each with its G query heads) take a block's 16
 * scores each as D multiply-adds of a broadcast query element by a vector of keys, with no
 * reduction, and fold them into an online softmax (a running maximum and sum per query) and
 * the values' weighted sum, block after block up to the tile's last position. A 16-bit cache
 * (bfloat16, float16) is widened on the way: the keys as they are transposed, the values
 * into float32 blocks beside them, once per KV head and chunk.
 *
 * Layouts (strides in elements), as decode_attention.c's:
 *   q, out     query head h of packed row r at h * head_stride + r * row_stride, head_dim
 *              contiguous floats
 *   caches     [num_kv_heads, num_blocks, 16, head_dim], contiguous, of kv_kind 0 (float32),
 *              1 (bfloat16) or 2 (float16)
 *   chunks     [num_chunks, 4]: its first packed row, its rows (tokens), the position of
 *              its first token, and the row of `tables` that holds its block table
 *   tables     [*, table_width] block ids
 * A chunk's token at position p attends over positions [0, p] (no sliding window). The
 * caller sees to the shapes this kernel takes (`chunk_attention_fits` in native.py): blocks
 * of 16 positions, head_dim a multiple of 16 up to 256, G = num_heads / num_kv_heads
 * dividing 16. scratch: the transposed keys, num_kv_heads * head_dim floats per position of
 * each chunk's keys (its end position rounded up to 16), chunk after chunk; twice that for a
 * 16-bit cache (its values widened too).
 *
 * Built by kernels/native.py; on x86-64 one clone per instruction set. */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

#define BLOCK 16  /* positions per cache block, and keys per score vector */
#define TILE 16   /* query vectors per tile */
#define MASKED (-1e30f)  /* a masked score: -ffast-math assumes no infinities */

/* One tile: TILE query vectors (tokens t0 .. t0 + TILE / G - 1 of the chunk, each with its G
 * heads; those past the chunk's end computed on zeros and not stored) over keys [0, last
 * token's position]. D is a constant where the caller inlines it with one. */
static inline __attribute__((always_inline)) void chunk_tile(
    const float *q, int64_t q_head_stride, int64_t q_row_stride, float *out,
    int64_t out_head_stride, int64_t out_row_stride, int64_t head0, int64_t G, int64_t row0,
    int64_t t0, int64_t n, int64_t start, const float *keys_t, const float *values,
    const int64_t *table, const int64_t D, float scale)
{
    const int64_t per_token = TILE / G;
    const int64_t tokens = n - t0 < per_token ? n - t0 : per_token;
    const v16f iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16f masked = (v16f){0} + MASKED;
    float qs[TILE][D];
    v16f o[TILE][D / 16];
    float top[TILE], sum[TILE];
    for (int64_t m = 0; m < TILE; m++) {
        const int64_t t = m / G, g = m % G;
        const float *src = q + (head0 + g) * q_head_stride + (row0 + t0 + t) * q_row_stride;
        for (int64_t d = 0; d < D; d++) qs[m][d] = t < tokens ? src[d] * scale : 0.f;
        for (int64_t i = 0; i < D / 16; i++) o[m][i] = (v16f){0};
        top[m] = MASKED;
        sum[m] = 0.f;
    }
    const int64_t first_pos = start + t0, last_pos = start + t0 + tokens - 1;
    for (int64_t b = 0; b * BLOCK <= last_pos; b++) {
        const float *kt = keys_t + b * BLOCK * D;  /* [D, 16] */
        v16f s[TILE];
        for (int64_t m = 0; m < TILE; m++) s[m] = (v16f){0};
        for (int64_t d = 0; d < D; d++) {
            const v16f k = *(const v16f *)(kt + d * BLOCK);
            for (int64_t m = 0; m < TILE; m++) s[m] += qs[m][d] * k;
        }
        /* [16, D]: in the cache, or widened in order (no table) */
        const float *v = values + (table ? table[b] : b) * BLOCK * D;
        const int64_t base = b * BLOCK;
        /* the block's keys that some query of the tile sees: those after are masked for
         * every query, and their slots may hold anything (another sequence's, or none) */
        const int64_t seen = last_pos + 1 - base < BLOCK ? last_pos + 1 - base : BLOCK;
        for (int64_t m = 0; m < TILE; m++) {
            const int64_t pos = first_pos + m / G;
            v16f sv = s[m];
            if (base + BLOCK - 1 > pos) {  /* keys past this query's position: masked */
                const m16 keep = iota <= (float)(pos - base);
                sv = (v16f)(((m16)sv & keep) | ((m16)masked & ~keep));
            }
            float p[BLOCK];
            *(v16f *)p = sv;
            float block_top = MASKED;
            #pragma omp simd reduction(max:block_top)
            for (int64_t j = 0; j < BLOCK; j++) block_top = p[j] > block_top ? p[j] : block_top;
            const float new_top = block_top > top[m] ? block_top : top[m];
            const float carry = expf(top[m] - new_top);
            float block_sum = 0.f;
            #pragma omp simd reduction(+:block_sum)
            for (int64_t j = 0; j < BLOCK; j++) {
                p[j] = expf(p[j] - new_top);
                block_sum += p[j];
            }
            top[m] = new_top;
            sum[m] = sum[m] * carry + block_sum;
            v16f acc[D / 16];
            for (int64_t i = 0; i < D / 16; i++) acc[i] = o[m][i] * carry;
            for (int64_t j = 0; j < seen; j++) {
                const float w = p[j];
                const float *vj = v + j * D;
                for (int64_t i = 0; i < D / 16; i++) acc[i] += w * *(const v16f *)(vj + 16 * i);
            }
            for (int64_t i = 0; i < D / 16; i++) o[m][i] = acc[i];
        }
    }
    for (int64_t m = 0; m < G * tokens; m++) {
        const int64_t t = m / G, g = m % G;
        float *dst = out + (head0 + g) * out_head_stride + (row0 + t0 + t) * out_row_stride;
        const v16f inv = (v16f){0} + 1.f / sum[m];
        for (int64_t i = 0; i < D / 16; i++) *(v16f *)(dst + 16 * i) = o[m][i] * inv;
    }
}

/* Keys [0, end) of one KV head (elements of type KV, widened by WIDEN) through `table`,
 * transposed block by block into keys_t: block b's [16, D] as [D, 16] at keys_t + b * 16 * D
 * (positions past `end` in the last block copied too: they are masked); and where `values_w`
 * is not NULL, the values' blocks widened in order into it. */
#define TRANSPOSE(name, KV, WIDEN)                                                            \
    static void name(const KV *keys, const KV *values, const int64_t *table, int64_t end,     \
                     int64_t D, float *keys_t, float *values_w)                              \
    {                                                                                         \
        for (int64_t b = 0; b * BLOCK < end; b++) {                                           \
            const KV *k = keys + table[b] * BLOCK * D;                                        \
            float *kt = keys_t + b * BLOCK * D;                                               \
            for (int64_t j = 0; j < BLOCK; j++)                                               \
                for (int64_t d = 0; d < D; d++) kt[d * BLOCK + j] = WIDEN(k[j * D + d]);     \
            if (values_w) {                                                                   \
                const KV *v = values + table[b] * BLOCK * D;                                  \
                float *vw = values_w + b * BLOCK * D;                                         \
                for (int64_t i = 0; i < BLOCK * D; i++) vw[i] = WIDEN(v[i]);                  \
            }                                                                                 \
        }                                                                                     \
    }
#define AS_IS(x) (x)
TRANSPOSE(transpose_f32, float, AS_IS)
TRANSPOSE(transpose_bf16, uint16_t, widen_bf16)
TRANSPOSE(transpose_f16, uint16_t, widen_f16)
#undef AS_IS
#undef TRANSPOSE

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };  /* as layer_ops.c's */

/* The floats of one KV head's transposed keys for a chunk ending at `end`. */
static inline int64_t keys_t_size(int64_t end, int64_t head_dim)
{
    return (end + BLOCK - 1) / BLOCK * BLOCK * head_dim;
}

CLONES
void meshlm_chunk_attention(
    const float *q, int64_t q_head_stride, int64_t q_row_stride,
    float *out, int64_t out_head_stride, int64_t out_row_stride,
    const int64_t *chunks, int64_t num_chunks, const int64_t *tables, int64_t table_width,
    const void *k_cache, const void *v_cache, int kv_kind, int64_t num_blocks,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *scratch, int threads)
{
    const int64_t G = num_heads / num_kv_heads, per_token = TILE / G;
    const int64_t head_size = num_blocks * BLOCK * head_dim;
    const int64_t copies = kv_kind == KV_F32 ? 1 : 2;  /* the keys, and widened values */
    /* Where each chunk's transposed keys start in scratch, and its tiles per KV head. */
    int64_t at[num_chunks + 1], tiles[num_chunks + 1];
    at[0] = tiles[0] = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t *chunk = chunks + 4 * c;
        at[c + 1] = at[c] + copies * num_kv_heads * keys_t_size(chunk[2] + chunk[1], head_dim);
        tiles[c + 1] = tiles[c] + num_kv_heads * ((chunk[1] + per_token - 1) / per_token);
    }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t c = 0; c < num_chunks; c++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t *chunk = chunks + 4 * c;
                const int64_t end = chunk[2] + chunk[1], size = keys_t_size(end, head_dim);
                const int64_t *table = tables + chunk[3] * table_width;
                float *keys_t = scratch + at[c] + copies * h * size;
                if (kv_kind == KV_F32)
                    transpose_f32((const float *)k_cache + h * head_size, NULL, table, end,
                                  head_dim, keys_t, NULL);
                else if (kv_kind == KV_BF16)
                    transpose_bf16((const uint16_t *)k_cache + h * head_size,
                                   (const uint16_t *)v_cache + h * head_size, table, end,
                                   head_dim, keys_t, keys_t + size);
                else
                    transpose_f16((const uint16_t *)k_cache + h * head_size,
                                  (const uint16_t *)v_cache + h * head_size, table, end,
                                  head_dim, keys_t, keys_t + size);
            }
        }
        /* Every (chunk, KV head, tile), the longest tiles (a chunk's last) first. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < tiles[num_chunks]; w++) {
            int64_t c = 0;
            while (w >= tiles[c + 1]) c++;
            const int64_t *chunk = chunks + 4 * c;
            const int64_t n = chunk[1], end = chunk[2] + n;
            const int64_t per_head = (tiles[c + 1] - tiles[c]) / num_kv_heads;
            const int64_t h = (w - tiles[c]) / per_head;
            const int64_t t0 = (per_head - 1 - (w - tiles[c]) % per_head) * per_token;
            const int64_t size = keys_t_size(end, head_dim);
            const float *keys_t = scratch + at[c] + copies * h * size;
            const int64_t *table = kv_kind == KV_F32 ? tables + chunk[3] * table_width : NULL;
            const float *values = kv_kind == KV_F32 ? (const float *)v_cache + h * head_size
                                                    : keys_t + size;
#define TILE_OF(D)                                                                            \
    chunk_tile(q, q_head_stride, q_row_stride, out, out_head_stride, out_row_stride, h * G, G, \
               chunk[0], t0, n, chunk[2], keys_t, values, table, D, scale)
            switch (head_dim) {
            case 32: TILE_OF(32); break;
            case 64: TILE_OF(64); break;
            case 128: TILE_OF(128); break;
            default: TILE_OF(head_dim);
            }
#undef TILE_OF
        }
    }
}
