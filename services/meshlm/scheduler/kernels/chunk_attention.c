/* Causal attention of prompt chunks over the paged KV cache, as matrix products: the
 * decode kernel (decode_attention.c) takes one query row at a time and reduces every
 * query-key product across a vector, which holds a chunk of a few hundred tokens to about 50
 * GFLOP/s on 2 threads. Here tiles of 16 query vectors (16 / G tokens, each with its G query
 * heads), held transposed, take each cache block's scores as one vector per key (a lane per
 * query): D multiply-adds of a broadcast key element by a vector of query elements, with no
 * reduction. The online softmax (a running maximum and sum per query) then runs across the
 * tile's 16 queries at once, and the values' weighted sum follows, block after block up to
 * the tile's last position. A 16-bit cache (bfloat16, float16) is first widened, keys and
 * values, once per KV head and chunk; a float32 one is read in place.
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
 * dividing 16. scratch: for a 16-bit cache, its widened keys and values: 2 * num_kv_heads *
 * head_dim floats per position of each chunk's keys (its end position rounded up to 16),
 * chunk after chunk; none for float32.
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

/* e^x in each lane (one vectorized expf call where the CPU has one). */
static inline __attribute__((always_inline)) v16f exp16(v16f x)
{
    float a[16];
    *(v16f *)a = x;
    #pragma omp simd
    for (int i = 0; i < 16; i++) a[i] = expf(a[i]);
    return *(const v16f *)a;
}

/* One tile: TILE query vectors (tokens t0 .. t0 + TILE / G - 1 of the chunk, each with its G
 * heads; those past the chunk's end computed on zeros and not stored) over keys [0, last
 * token's position], the queries held transposed so that a block's scores come as one vector
 * per key, a lane per query: the softmax's maxima, exponentials and sums then run across
 * the tile's 16 queries at once. Keys and values [16, D] per block: in the cache through
 * `table`, or widened in order (table NULL). D is a constant where the caller inlines it. */
static inline __attribute__((always_inline)) void chunk_tile(
    const float *q, int64_t q_head_stride, int64_t q_row_stride, float *out,
    int64_t out_head_stride, int64_t out_row_stride, int64_t head0, int64_t G, int64_t row0,
    int64_t t0, int64_t n, int64_t start, const float *keys, const float *values,
    const int64_t *table, const int64_t D, float scale)
{
    const int64_t per_token = TILE / G;
    const int64_t tokens = n - t0 < per_token ? n - t0 : per_token;
    const v16f masked = (v16f){0} + MASKED;
    float qt[D][TILE];  /* [d][query] */
    float lane_pos[TILE];
    v16f o[TILE][D / 16];
    for (int64_t m = 0; m < TILE; m++) {
        const int64_t t = m / G, g = m % G;
        const float *src = q + (head0 + g) * q_head_stride + (row0 + t0 + t) * q_row_stride;
        for (int64_t d = 0; d < D; d++) qt[d][m] = t < tokens ? src[d] * scale : 0.f;
        for (int64_t i = 0; i < D / 16; i++) o[m][i] = (v16f){0};
        lane_pos[m] = (float)(start + t0 + t);
    }
    const v16f pos = *(const v16f *)lane_pos;
    v16f top = masked, sum = (v16f){0};
    const int64_t first_pos = start + t0, last_pos = start + t0 + tokens - 1;
    for (int64_t b = 0; b * BLOCK <= last_pos; b++) {
        const int64_t at = (table ? table[b] : b) * BLOCK * D;
        const float *k = keys + at, *v = values + at;  /* [16, D] each */
        const int64_t base = b * BLOCK;
        /* the block's keys that some query of the tile sees: those after are masked for
         * every query, and their slots may hold anything (another sequence's, or none) */
        const int64_t seen = last_pos + 1 - base < BLOCK ? last_pos + 1 - base : BLOCK;
        v16f s[BLOCK];
        for (int64_t j = 0; j < BLOCK; j++) s[j] = (v16f){0};
        for (int64_t d = 0; d < D; d++) {
            const v16f qd = *(const v16f *)qt[d];
            for (int64_t j = 0; j < BLOCK; j++) s[j] += k[j * D + d] * qd;
        }
        v16f block_top = masked;
        for (int64_t j = 0; j < seen; j++) {
            if (base + j > first_pos) {  /* past some queries' positions: masked there */
                const m16 keep = (v16f){0} + (float)(base + j) <= pos;
                s[j] = (v16f)(((m16)s[j] & keep) | ((m16)masked & ~keep));
            }
            const m16 larger = s[j] > block_top;
            block_top = (v16f)(((m16)s[j] & larger) | ((m16)block_top & ~larger));
        }
        const m16 rises = block_top > top;
        const v16f new_top = (v16f)(((m16)block_top & rises) | ((m16)top & ~rises));
        const v16f carry = exp16(top - new_top);
        float p[BLOCK][TILE];  /* [key][query] */
        v16f block_sum = (v16f){0};
        for (int64_t j = 0; j < seen; j++) {
            const v16f e = exp16(s[j] - new_top);
            *(v16f *)p[j] = e;
            block_sum += e;
        }
        top = new_top;
        sum = sum * carry + block_sum;
        for (int64_t m = 0; m < TILE; m++) {
            v16f acc[D / 16];
            for (int64_t i = 0; i < D / 16; i++) acc[i] = o[m][i] * carry[m];
            for (int64_t j = 0; j < seen; j++) {
                const float w = p[j][m];
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

/* Keys and values [0, end) of one KV head of a 16-bit cache (elements of type KV, widened
 * by WIDEN) through `table`, widened block by block in order into keys_w and values_w
 * (positions past `end` in the last block too: they are never weighed). */
#define WIDEN_BLOCKS(name, KV, WIDEN)                                                         \
    static void name(const KV *keys, const KV *values, const int64_t *table, int64_t end,     \
                     int64_t D, float *keys_w, float *values_w)                              \
    {                                                                                         \
        for (int64_t b = 0; b * BLOCK < end; b++) {                                           \
            const KV *k = keys + table[b] * BLOCK * D, *v = values + table[b] * BLOCK * D;    \
            float *kw = keys_w + b * BLOCK * D, *vw = values_w + b * BLOCK * D;               \
            for (int64_t i = 0; i < BLOCK * D; i++) {                                         \
                kw[i] = WIDEN(k[i]);                                                          \
                vw[i] = WIDEN(v[i]);                                                          \
            }                                                                                 \
        }                                                                                     \
    }
WIDEN_BLOCKS(widen_blocks_bf16, uint16_t, widen_bf16)
WIDEN_BLOCKS(widen_blocks_f16, uint16_t, widen_f16)
#undef WIDEN_BLOCKS

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };  /* as layer_ops.c's */

/* The floats of one KV head's keys (or values) for a chunk ending at `end`, widened. */
static inline int64_t widened_size(int64_t end, int64_t head_dim)
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
    const int64_t copies = kv_kind == KV_F32 ? 0 : 2;  /* a 16-bit cache's keys and values */
    /* Where each chunk's widened keys start in scratch, and its tiles per KV head. */
    int64_t at[num_chunks + 1], tiles[num_chunks + 1];
    at[0] = tiles[0] = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t *chunk = chunks + 4 * c;
        at[c + 1] = at[c] + copies * num_kv_heads * widened_size(chunk[2] + chunk[1], head_dim);
        tiles[c + 1] = tiles[c] + num_kv_heads * ((chunk[1] + per_token - 1) / per_token);
    }
    #pragma omp parallel num_threads(threads)
    {
        if (kv_kind != KV_F32) {
            #pragma omp for collapse(2) schedule(dynamic, 1)
            for (int64_t c = 0; c < num_chunks; c++) {
                for (int64_t h = 0; h < num_kv_heads; h++) {
                    const int64_t *chunk = chunks + 4 * c;
                    const int64_t end = chunk[2] + chunk[1], size = widened_size(end, head_dim);
                    const int64_t *table = tables + chunk[3] * table_width;
                    const uint16_t *k = (const uint16_t *)k_cache + h * head_size;
                    const uint16_t *v = (const uint16_t *)v_cache + h * head_size;
                    float *keys_w = scratch + at[c] + copies * h * size;
                    if (kv_kind == KV_BF16)
                        widen_blocks_bf16(k, v, table, end, head_dim, keys_w, keys_w + size);
                    else
                        widen_blocks_f16(k, v, table, end, head_dim, keys_w, keys_w + size);
                }
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
            const int64_t size = widened_size(end, head_dim);
            const float *keys, *values;
            const int64_t *table = NULL;
            if (kv_kind == KV_F32) {
                keys = (const float *)k_cache + h * head_size;
                values = (const float *)v_cache + h * head_size;
                table = tables + chunk[3] * table_width;
            } else {
                keys = scratch + at[c] + copies * h * size;
                values = keys + size;
            }
#define TILE_OF(D)                                                                            \
    chunk_tile(q, q_head_stride, q_row_stride, out, out_head_stride, out_row_stride, h * G, G, \
               chunk[0], t0, n, chunk[2], keys, values, table, D, scale)
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
