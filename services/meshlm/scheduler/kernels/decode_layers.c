/* A decode step's whole decoder stack in one call: every layer of a Llama-family model, for
 * rows that are each one new token, through the other kernels of this library in the order
 * `fused_forward` (models/llama_fused.py) calls them from Python:
 *
 *     add + RMSNorm -> qkv matmul -> RoPE in place -> KV write -> decode attention
 *     -> o matmul -> add + RMSNorm -> gate_up matmul -> SiLU * up -> down matmul
 *
 * and the final add + RMSNorm, then, where the step asks (`head`), the LM head's matmul. The
 * same calls on the same arrays, so the same results to the
 * bit. Where the step keeps only some rows (`kept`: those it samples), the last layer goes
 * past the KV write for those rows only. What it saves is Python's share of a step: about
 * ten ctypes calls and a dozen torch ops a layer, each several microseconds (measured on the
 * bench model at one row, 2 threads: 3.7 ms a step, 2.6 of it in the kernels, about 1 ms
 * outside them), and, in the scheduler service, the engine thread's every return to the GIL
 * while the event loop sends the last step's outputs (the call holds no GIL from the first
 * layer to the last).
 *
 * Layouts: x, the residual stream, [rows, hidden] (updated in place); the projections packed
 * by `NativePacking` (float32 or bfloat16, `weight_kind` 0 or 1); the caches as
 * decode_attention.c reads them, layer l's at k_cache + l * layer_elements (of `kv_kind`,
 * store_kv's kinds); cos and signed_sin [rows, head_dim], or the rows `positions` of such
 * tables; slots [rows], the cache slot of each row's token; tables [rows, table_width] the
 * block tables, in the order of the packed rows `attention_rows` [rows] (build_attention_meta's
 * one decode group), and first and last [rows] in that order too, first per layer (a sliding
 * window's differs; NULL: 0 for every row). `work` holds the activations: rows * (2 + 2 *
 * head_dim + hidden + qkv + heads * head_dim + hidden + 2 * inter + inter) floats.
 * Built with the other kernels by kernels/native.py. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The kernels called, from layer_ops.c, linear.c and decode_attention.c. */
void meshlm_add_rmsnorm_f32(float *x, const float *add, const float *weight, float *out,
                            int64_t rows, int64_t hidden, float eps, int threads);
void meshlm_rope_f32(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,
                     const float *cos, const float *signed_sin, int threads);
void meshlm_store_kv(const float *k, int64_t k_stride, int64_t k_head_stride,
                     const float *v, int64_t v_stride, int64_t v_head_stride,
                     int64_t rows, int64_t heads, int64_t head_dim, const int64_t *slots,
                     void *k_cache, void *v_cache, int64_t head_slots, int kind);
void meshlm_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                         int threads);
void meshlm_linear_f32(const float *x, int64_t ldx, int64_t rows, int64_t in,
                       const float *packed, const float *bias, float *y, int64_t out,
                       int threads);
void meshlm_linear_bf16(const float *x, int64_t ldx, int64_t rows, int64_t in,
                        const uint16_t *packed, const float *bias, float *y, int64_t out,
                        int threads);
#define DECODE_ATTENTION(suffix, KV)                                                          \
    void meshlm_decode_attention_##suffix(                                                    \
        const float *q, int64_t q_head_stride, int64_t q_row_stride, float *out,              \
        int64_t out_head_stride, int64_t out_row_stride, const int64_t *rows,                 \
        const int64_t *tables, int64_t table_width, const int64_t *first,                     \
        const int64_t *last, const KV *k_cache, const KV *v_cache, int64_t num_blocks,        \
        int64_t block_size, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,        \
        int64_t head_dim, float scale, float *scratch, int64_t scratch_per_thread,            \
        int threads);
DECODE_ATTENTION(f32, float)
DECODE_ATTENTION(bf16, uint16_t)
DECODE_ATTENTION(f16, uint16_t)
void meshlm_chunk_attention(
    const float *q, int64_t q_head_stride, int64_t q_row_stride, float *out,
    int64_t out_head_stride, int64_t out_row_stride, const int64_t *chunks, int64_t num_chunks,
    const int64_t *tables, int64_t table_width, const void *k_cache, const void *v_cache,
    int kv_kind, int64_t num_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, float *scratch, int threads);

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };  /* as layer_ops.c's */

/* One layer's weights: the four packed projections with their biases (NULL: none), the two
 * norms' weights and epsilons, and where its attention starts per row (`first`; NULL, as
 * for a layer without a sliding window: at position 0). */
struct meshlm_layer {
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *input_norm, *post_norm;
    const int64_t *first;
    float input_eps, post_eps;
};

/* The model's shapes and the step's arrays that every layer shares. */
struct meshlm_decode_step {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter;
    int weight_kind, kv_kind;
    const float *cos, *signed_sin;
    const int64_t *slots, *attention_rows, *tables, *last;
    int64_t table_width;
    void *k_cache, *v_cache;  /* layer 0's; layer l's at + l * layer_elements */
    int64_t layer_elements, num_blocks, block_size;
    float scale;
    float *scratch;
    int64_t scratch_per_thread;
    float *work;
    /* Prompt chunks through chunk_attention.c: the first `decode_rows` of
     * attention_rows (and of tables, first and last) are the decode kernel's, the chunks
     * [num_chunks, 4] the chunk kernel's, with their own scratch. num_chunks 0: every row
     * through the decode kernel, prompt chunks' tokens too. */
    const int64_t *chunks;
    int64_t num_chunks, decode_rows;
    float *chunk_scratch;
    /* The rows whose hidden states the step returns (`kept`, NULL: every row). The last
     * layer computes every row's keys and values, then only the kept rows: their attention
     * through the decode kernel (kept_tables [num_kept, table_width], kept_first and
     * kept_last [num_kept]; kept_order 0 .. num_kept - 1), the o projection and the MLP.
     * hidden_out is then [num_kept, hidden]; `work` holds num_kept * (hidden + 2 * heads *
     * head_dim) floats more. */
    const int64_t *kept, *kept_tables, *kept_first, *kept_last, *kept_order;
    int64_t num_kept;
    /* The layers' input, where `ids` is not NULL: the rows ids [rows] of `embed` [vocab,
     * hidden] copied into x (an id outside the table reads as zeros: admission refuses
     * them before, `Sequence.problem`). Else x holds it already. */
    const int64_t *ids;
    const float *embed;
    int64_t vocab;
    /* NULL: cos and signed_sin hold a row per packed row. Else they are tables with a row
     * per position (P rows, the caller's, past every one of `positions`), and row r's are
     * those of positions[r]. */
    const int64_t *positions;
    /* Where not NULL: the LM head, packed as the projections are (its own `head_kind`, bias
     * `head_bias` or NULL), multiplies the final hidden states into logits [rows out,
     * head_out] (rows out: num_kept, or rows): the step's one more matmul without a return
     * to Python between. */
    const void *head;
    const float *head_bias;
    float *logits;
    int64_t head_out;
    int head_kind;
};

static void linear_of(int kind, int64_t rows, const float *x, int64_t in, const void *packed,
                      const float *bias, float *y, int64_t out, int threads)
{
    if (kind == 0)
        meshlm_linear_f32(x, in, rows, in, packed, bias, y, out, threads);
    else
        meshlm_linear_bf16(x, in, rows, in, packed, bias, y, out, threads);
}

static void linear(const struct meshlm_decode_step *s, int64_t rows, const float *x, int64_t in,
                   const void *packed, const float *bias, float *y, int64_t out, int threads)
{
    linear_of(s->weight_kind, rows, x, in, packed, bias, y, out, threads);
}

/* The decode kernel over `rows` rows: q's at packed rows `order`, each attending from
 * first to last over its block table (`tables`). */
static void attend_rows(const struct meshlm_decode_step *s, const float *q,
                        int64_t q_row_stride, float *out, int64_t rows, const int64_t *order,
                        const int64_t *tables, const int64_t *first, const int64_t *last,
                        const void *kc, const void *vc, int threads)
{
    const int64_t d = s->head_dim;
    if (rows == 0)
        return;
#define ATTEND(suffix, KV)                                                                    \
    meshlm_decode_attention_##suffix(q, d, q_row_stride, out, d, s->heads * d, order, tables, \
                                     s->table_width, first, last, (const KV *)kc,             \
                                     (const KV *)vc, s->num_blocks, s->block_size, rows,      \
                                     s->heads, s->kv_heads, d, s->scale, s->scratch,          \
                                     s->scratch_per_thread, threads)
    if (s->kv_kind == KV_F32)
        ATTEND(f32, float);
    else if (s->kv_kind == KV_BF16)
        ATTEND(bf16, uint16_t);
    else
        ATTEND(f16, uint16_t);
#undef ATTEND
}

static void attend(const struct meshlm_decode_step *s, const float *q, int64_t q_row_stride,
                   float *out, const int64_t *first, const void *kc, const void *vc,
                   int threads)
{
    const int64_t d = s->head_dim;
    if (s->num_chunks)
        meshlm_chunk_attention(q, d, q_row_stride, out, d, s->heads * d, s->chunks,
                               s->num_chunks, s->tables, s->table_width, kc, vc, s->kv_kind,
                               s->num_blocks, s->heads, s->kv_heads, d, s->scale,
                               s->chunk_scratch, threads);
    attend_rows(s, q, q_row_stride, out, s->num_chunks ? s->decode_rows : s->rows,
                s->attention_rows, s->tables, first, s->last, kc, vc, threads);
}

/* x [rows, hidden] through `num_layers` layers, then the final norm into `hidden_out` (and
 * the LM head into `s->logits`, where `s->head` is set). */
void meshlm_decode_layers(const struct meshlm_decode_step *s, const struct meshlm_layer *layers,
                          int64_t num_layers, float *x, const float *final_norm,
                          float final_eps, float *hidden_out, int threads)
{
    const int64_t n = s->rows, h = s->hidden, d = s->head_dim;
    const int64_t qkv_width = (s->heads + 2 * s->kv_heads) * d, attn_width = s->heads * d;
    const int64_t kv_element = s->kv_kind == KV_F32 ? 4 : 2;
    int64_t *zeros = (int64_t *)s->work;  /* `first` of the layers that leave it NULL */
    float *cos = s->work + 2 * n, *signed_sin = cos + n * d;
    float *normed = signed_sin + n * d;
    float *qkv = normed + n * h;
    float *attn = qkv + n * qkv_width;
    float *pending = attn + n * attn_width;  /* o's output, then down's (the MLP's) */
    float *gate_up = pending + n * h;
    float *act = gate_up + n * 2 * s->inter;
    const float *add = NULL;  /* the last layer's MLP output, not yet added to x */
    int64_t m = n;  /* rows past the attention: n, or the kept ones in the last layer */
    memset(zeros, 0, (size_t)n * sizeof *zeros);
    if (s->positions == NULL) {
        cos = (float *)s->cos;
        signed_sin = (float *)s->signed_sin;
    }
#pragma omp parallel for num_threads(threads) if (n * h >= (1 << 18))
    for (int64_t r = 0; r < n; r++) {
        if (s->ids != NULL) {
            const int64_t id = s->ids[r];
            if (id >= 0 && id < s->vocab)
                memcpy(x + r * h, s->embed + id * h, (size_t)h * sizeof *x);
            else
                memset(x + r * h, 0, (size_t)h * sizeof *x);
        }
        if (s->positions != NULL) {
            memcpy(cos + r * d, s->cos + s->positions[r] * d, (size_t)d * sizeof *cos);
            memcpy(signed_sin + r * d, s->signed_sin + s->positions[r] * d,
                   (size_t)d * sizeof *cos);
        }
    }
    for (int64_t l = 0; l < num_layers; l++) {
        const struct meshlm_layer *w = &layers[l];
        char *kc = (char *)s->k_cache + l * s->layer_elements * kv_element;
        char *vc = (char *)s->v_cache + l * s->layer_elements * kv_element;
        meshlm_add_rmsnorm_f32(x, add, w->input_norm, normed, n, h, w->input_eps, threads);
        linear(s, n, normed, h, w->qkv, w->qkv_bias, qkv, qkv_width, threads);
        meshlm_rope_f32(qkv, n, qkv_width, s->heads + s->kv_heads, d, cos, signed_sin,
                        threads);
        const float *k = qkv + s->heads * d, *v = k + s->kv_heads * d;
        meshlm_store_kv(k, qkv_width, d, v, qkv_width, d, n, s->kv_heads, d, s->slots, kc, vc,
                        s->num_blocks * s->block_size, s->kv_kind);
        if (l == num_layers - 1 && s->kept != NULL) {
            /* Only the kept rows go on: their residual and queries gathered, then their
             * attention row by row. */
            m = s->num_kept;
            float *xk = act + n * s->inter, *qk = xk + m * h, *attn_k = qk + m * attn_width;
            for (int64_t i = 0; i < m; i++) {
                memcpy(xk + i * h, x + s->kept[i] * h, (size_t)h * sizeof *x);
                memcpy(qk + i * attn_width, qkv + s->kept[i] * qkv_width,
                       (size_t)attn_width * sizeof *qkv);
            }
            x = xk;
            attn = attn_k;
            attend_rows(s, qk, attn_width, attn, m, s->kept_order, s->kept_tables,
                        s->kept_first, s->kept_last, kc, vc, threads);
        } else {
            attend(s, qkv, qkv_width, attn, w->first != NULL ? w->first : zeros, kc, vc,
                   threads);
        }
        linear(s, m, attn, attn_width, w->o, w->o_bias, pending, h, threads);
        meshlm_add_rmsnorm_f32(x, pending, w->post_norm, normed, m, h, w->post_eps, threads);
        linear(s, m, normed, h, w->gate_up, w->gate_up_bias, gate_up, 2 * s->inter, threads);
        meshlm_silu_mul_f32(gate_up, act, m, s->inter, threads);
        linear(s, m, act, s->inter, w->down, w->down_bias, pending, h, threads);
        add = pending;
    }
    meshlm_add_rmsnorm_f32(x, add, final_norm, hidden_out, m, h, final_eps, threads);
    if (s->head != NULL)
        linear_of(s->head_kind, m, hidden_out, h, s->head, s->head_bias, s->logits, s->head_out,
                  threads);
}
