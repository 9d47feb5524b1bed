/* y = x W^T + b on the CPU, x and y float32, over a weight packed once in 16-column blocks:
 * block j holds W's rows 16j..16j+15 transposed, so one aligned run of 16 elements is one
 * input's weights into 16 outputs; the blocks run to a multiple of 32 columns, the padding
 * zero (`NativePacking` in models/cpu_linear.py packs them). The weights are float32
 * (meshlm_linear_f32: a block is [K][16]) or bfloat16 (meshlm_linear_bf16: half the bytes to
 * read; a block is [K/2][16][2], each column's weights for inputs 2p and 2p+1 side by side,
 * K rounded up to even with a zero input).
 *
 * A decode step multiplies a few rows by every weight of the model, so it is bound by reading
 * the weights: each block is read once per step and every row of the step is multiplied
 * against it while it is in cache, the rows' partial sums held in registers. On this
 * project's 2-core AVX-512 machine that reads the bench model's weights at 49 GB/s at one
 * row, where oneDNN's packed kernels read them at 29 (2.1 ms a pass against 3.5), and keeps
 * level with them from 64 rows to prompt chunks of 2048 (both at 220 GFLOP/s). Where the CPU
 * has AVX2 and FMA but not AVX-512 (a 2-core AMD EPYC VM, 2026-11-29), 8-wide tiles serve
 * instead of the portable ones (which are 2-3x slower from 4 rows): against oneDNN's packed
 * kernels, 2 threads, a pass over all of the bench model's projections and its head (105 MB)
 * took 3.1 against 4.5 ms at one row (34 GB/s), 4.1 against 6.1 at 4, 7.9 against 10.4 at
 * 16, 21.6 against 27.6 at 64 and 80 against 91 at 256; the tiny default model's 0.19
 * against 0.69 ms at one row, 0.70 against 1.34 at 16 and 8.3 against 9.4 at 256 (oneDNN's
 * call costs tens of microseconds).
 *
 * bfloat16 weights: where the CPU has AVX512_BF16 (meshlm_linear_bf16_dot), the activations
 * are rounded to bfloat16 too (to nearest even) and each pair of products is summed into
 * float32 by one instruction (vdpbf16ps: twice the multiplies of a float32 FMA), as llama.cpp
 * does with bfloat16 weights; elsewhere each weight is widened to float32 exactly as it is
 * loaded, the activations and the arithmetic float32.
 *
 * Work is shared among torch's OpenMP threads by column groups, handed out as threads come free
 * (`claim`, as schedule(dynamic) would): where the engine shares its cores with the rest of the
 * mesh, a thread the OS has descheduled does fewer groups instead of keeping the others waiting
 * at the region's end (`make bench-peers`' mesh, 2 threads on 2 cores, two alternated pairs:
 * 308.6 and 318.5 output tok/s against 286.3 and 267.7 split evenly); K is taken in chunks of KC
 * so that a group's chunk of weights stays in cache while every tile of rows reads it, and the
 * rows in blocks of MC, so that a prompt chunk's inputs are read from a core's L2 by each of its
 * column groups in turn, not from memory once per group (on a 2-core Sapphire Rapids VM, one
 * thread, the bench model's projections at 1,024-2,048 rows: 56-64 -> 61-73 GFLOP/s, the same
 * results to the bit; at 256 rows and fewer, one block, unchanged).
 * Built with the other kernels by kernels/native.py. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define BLOCK 16   /* columns per packed block */
#define KC 512     /* inputs per pass over the rows (even: a chunk starts on a pair) */
#define STAGE_TILES 3  /* row tiles up to which bfloat16 weights are widened in each */
#define MC 128     /* rows per block: a block's chunk of inputs (128 x KC floats, 256 KiB) stays
                    * in a core's L2 while each of its column groups reads it */

typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u4 __attribute__((vector_size(16), aligned(4)));
typedef uint32_t u16 __attribute__((vector_size(64), aligned(4)));
typedef float f32_t;
typedef uint16_t bf16_t;

/* Inputs a block holds weights for: K, or K rounded up to even (bfloat16 pairs). */
#define KPAD_f32(in) (in)
#define KPAD_bf16(in) (((in) + 1) & ~(int64_t)1)


/* A tile's sums into y: written (first chunk: bias + sum) or added (later chunks), `cols`
 * valid columns of NV vectors of LANES. */
#define STORE(V, LANES, NV, MT)                                                               \
    for (int m = 0; m < MT; m++) {                                                            \
        float *row = y + m * ldy;                                                             \
        if (cols == NV * LANES) {                                                             \
            for (int j = 0; j < NV; j++) {                                                    \
                V *out = (V *)(row + j * LANES);                                              \
                if (!first) *out += acc[m][j];                                                \
                else if (bias) *out = acc[m][j] + *(const V *)(bias + j * LANES);             \
                else *out = acc[m][j];                                                        \
            }                                                                                 \
        } else {                                                                              \
            float sums[NV * LANES];                                                           \
            memcpy(sums, acc[m], sizeof sums);                                                \
            for (int c = 0; c < cols; c++)                                                    \
                row[c] = (first ? (bias ? bias[c] : 0.f) : row[c]) + sums[c];                 \
        }                                                                                     \
    }

/* Reading the weights overlaps the arithmetic: while a row tile computes from one chunk of a
 * group's weights (in L1 or L2), it fetches the chunk its thread reads next into L2, one line
 * of 64 bytes per block and input (an input pair, bfloat16) per step; the first tile fetches
 * the group's first block, the second its second (a lone tile both). Without it a step of
 * few rows read each chunk from memory in its first tile and computed from cache in the
 * rest, one after the other. The bench model's projections and head (105 MB), 2 threads on the
 * 2-core AVX-512 VM of 2026-12-01, old and new kernels alternated in one process (ms, medians)
 * with the L3 flushed before each pass: 1 row 4.5 against 4.9, 4 rows 5.1 against 5.8, 8 rows
 * 5.3 against 7.0, 16 rows 7.4-8.7 against 9.2-11.1, 32 rows 14.2 against 16.6, 64 rows and
 * more level; with the weights left in the L3, 8 rows 3.4 against 4.7, 16 rows 6.2 against
 * 7.9. bfloat16 weights, 16 rows: 5.4 against 6.5 (widened), 6.4 against 7.3 (AVX512_BF16);
 * the AVX2 tiles 12.2 against 12.8. The same sums, bit for bit. */
#define LINE 64
struct ahead { const char *line0, *line1; int64_t lines; };

static inline __attribute__((always_inline)) void fetch_ahead(struct ahead a, int64_t step)
{
    if (step < a.lines) {
        __builtin_prefetch(a.line0 + step * LINE, 0, 2);
        if (a.line1) __builtin_prefetch(a.line1 + step * LINE, 0, 2);
    }
}

/* Work is (row block, column group) items handed out as threads come free, as
 * schedule(dynamic) hands out iterations, but a thread claims its next item before it starts
 * the current one, so that it knows whose weights to fetch ahead. */
static inline int64_t claim(int64_t *counter)
{
    return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}

/* The chunk read after group g's from input k0 (elements of `esz` bytes, blocks `stride`
 * elements apart, `per_group` blocks a group): the group's next KC inputs, else the first KC
 * of group `next_g` (none where it is negative). */
struct chunk { const char *start; int64_t lines; };
static inline struct chunk next_chunk(const void *packed, size_t esz, int64_t stride,
                                      int per_group, int64_t in, int64_t k0, int64_t g,
                                      int64_t next_g)
{
    struct chunk c = { NULL, 0 };
    int64_t first = 0;
    if (k0 + KC < in) first = k0 + KC;
    else if (next_g >= 0) g = next_g;
    else return c;
    const int64_t n = in - first < KC ? in - first : KC;
    c.start = (const char *)packed + ((g * per_group * stride + first * BLOCK) * (int64_t)esz);
    c.lines = (n * BLOCK * (int64_t)esz + LINE - 1) / LINE;
    return c;
}

/* What tile t of `tiles` fetches of chunk c. */
static inline struct ahead tile_ahead(struct chunk c, size_t esz, int64_t stride, int per_group,
                                      int64_t t, int64_t tiles)
{
    struct ahead a = { NULL, NULL, 0 };
    if (c.start == NULL || t >= per_group) return a;
    a.line0 = c.start + t * stride * (int64_t)esz;
    a.line1 = tiles == 1 && per_group == 2 ? a.line0 + stride * (int64_t)esz : NULL;
    a.lines = c.lines;
    return a;
}

/* The tile of MT rows by NV vectors of LANES columns (TILE over float32 weights): w at the
 * tile's first column and input k0 (blocks `stride` elements apart), inputs x (rows ldx
 * apart), kc inputs; its sums start at zero. */
#define TILE_HEAD(NAME, W, V, NV, MT)                                                         \
    static inline __attribute__((always_inline)) void NAME##_##MT(                          \
        const float *x, int64_t ldx, const W *w, int64_t stride, int64_t kc, float *y,       \
        int64_t ldy, int cols, const float *bias, int first, struct ahead ahead)            \
    {                                                                                         \
        V acc[MT][NV];                                                                        \
        for (int m = 0; m < MT; m++)                                                          \
            for (int j = 0; j < NV; j++) acc[m][j] = (V){0};
#define TILE(NAME, V, LANES, NV, MT)                                                          \
    TILE_HEAD(NAME, float, V, NV, MT)                                                         \
        for (int64_t k = 0; k < kc; k++) {                                                    \
            fetch_ahead(ahead, k);                                                            \
            V b[NV];                                                                          \
            for (int j = 0; j < NV; j++)                                                      \
                b[j] = *(const V *)(w + (j * LANES / BLOCK) * stride + k * BLOCK              \
                                    + j * LANES % BLOCK);                                     \
            _Pragma("GCC unroll 16") for (int m = 0; m < MT; m++) {                          \
                const float xv = x[m * ldx + k];                                              \
                for (int j = 0; j < NV; j++) acc[m][j] += xv * b[j];                          \
            }                                                                                 \
        }                                                                                     \
        STORE(V, LANES, NV, MT)                                                               \
    }

/* The same over bfloat16 pairs, widened as they load: one load of LANES pairs gives input
 * 2p's weights (the low halves, shifted up) and 2p+1's (the high halves, masked). */
#define PAIR_TILE(NAME, V, U, LANES, NV, MT)                                                  \
    TILE_HEAD(NAME, bf16_t, V, NV, MT)                                                        \
        for (int64_t k = 0; k < kc; k += 2) {                                                 \
            fetch_ahead(ahead, k / 2);                                                        \
            V lo[NV], hi[NV];                                                                 \
            for (int j = 0; j < NV; j++) {                                                    \
                U u = *(const U *)(w + (j * LANES / BLOCK) * stride + k * BLOCK               \
                                   + 2 * (j * LANES % BLOCK));                                \
                lo[j] = (V)(u << 16);                                                         \
                hi[j] = (V)(u & 0xffff0000u);                                                 \
            }                                                                                 \
            const int odd = k + 1 == kc; /* K odd: the last pair's second input is padding */ \
            _Pragma("GCC unroll 16") for (int m = 0; m < MT; m++) {                          \
                const float xe = x[m * ldx + k], xo = odd ? 0.f : x[m * ldx + k + 1];         \
                for (int j = 0; j < NV; j++) acc[m][j] += xe * lo[j] + xo * hi[j];           \
            }                                                                                 \
        }                                                                                     \
        STORE(V, LANES, NV, MT)                                                               \
    }

/* A group's chunk of bfloat16 pairs (GROUP / BLOCK blocks `stride` apart, kc inputs from an
 * even k0) widened into float32 blocks [kc][16] laid end to end, for the float32 tiles. */
static inline void widen_chunk(const bf16_t *w, int64_t stride, int64_t kc, int blocks,
                               float *buffer)
{
    for (int b = 0; b < blocks; b++)
        for (int64_t k = 0; k < kc; k++)
            for (int c = 0; c < BLOCK; c++)
                buffer[(b * kc + k) * BLOCK + c] =
                    widen_bf16(w[b * stride + (k & ~(int64_t)1) * BLOCK + 2 * c + (k & 1)]);
}

/* The multiply over tiles of at most MAXROWS rows (split evenly) and GROUP columns per
 * thread's unit of work. bfloat16 weights are widened as a tile loads them where up to
 * STAGE_TILES tiles cover the rows; where there are more, each chunk of them is widened once
 * into a float32 buffer that every tile then reads (FTILES: the float32 tiles). Measured on
 * the bench model's projections, bfloat16 against float32 on AVX-512: per tile 0.80x at 64
 * rows and 0.79x at 256, through the buffer 0.92x and 0.98x; the two level at 32 rows. */
#define LINEAR(NAME, W, GROUP, MAXROWS, DISPATCH, TILES, FTILES)                             \
    void NAME(const float *x, int64_t ldx, int64_t rows, int64_t in, const W##_t *packed,    \
              const float *bias, float *y, int64_t out, int threads)                          \
    {                                                                                         \
        const int64_t groups = (out + GROUP - 1) / GROUP;                                     \
        const int64_t blocks = (rows + MC - 1) / MC, items = blocks * groups;                 \
        const int64_t stride = KPAD_##W(in) * BLOCK;                                          \
        const int widens = sizeof(W##_t) != sizeof(float);                                    \
        const int per_group = GROUP / BLOCK;                                                  \
        int64_t counter = 0;                                                                  \
        _Pragma("omp parallel num_threads(threads) if (groups > 1)")                          \
        {                                                                                     \
            float buffer[widens ? GROUP * KC : 1];                                            \
            for (int64_t item = claim(&counter), next; item < items; item = next) {           \
                next = claim(&counter);                                                       \
                const int64_t b = item / groups, g = item % groups;                           \
                const int64_t b0 = b * rows / blocks, brows = (b + 1) * rows / blocks - b0;   \
                const int64_t tiles = (brows + MAXROWS - 1) / MAXROWS;                        \
                const int staged = widens && tiles > STAGE_TILES;                             \
                const int64_t col = g * GROUP;                                                \
                const int cols = out - col < GROUP ? (int)(out - col) : GROUP;                \
                for (int64_t k0 = 0; k0 < in; k0 += KC) {                                     \
                    const int64_t kc = in - k0 < KC ? in - k0 : KC;                           \
                    const W##_t *w = packed + (col / BLOCK) * stride + k0 * BLOCK;            \
                    const float *xb = x + b0 * ldx + k0;                                      \
                    float *yg = y + b0 * out + col;                                           \
                    const float *bg = bias ? bias + col : NULL;                               \
                    const struct chunk after = next_chunk(                                    \
                        packed, sizeof(W##_t), stride, per_group, in, k0, g,                  \
                        next < items ? next % groups : -1);                                   \
                    if (staged)                                                               \
                        widen_chunk((const bf16_t *)w, stride, kc, per_group, buffer);        \
                    for (int64_t t = 0; t < tiles; t++) {                                     \
                        const int64_t r0 = t * brows / tiles;                                 \
                        const int64_t mt = (t + 1) * brows / tiles - r0;                      \
                        const struct ahead ahead =                                            \
                            tile_ahead(after, sizeof(W##_t), stride, per_group, t, tiles);    \
                        if (staged) {                                                         \
                            DISPATCH(FTILES, mt, xb + r0 * ldx, ldx, buffer, kc * BLOCK, kc,  \
                                     yg + r0 * out, out, cols, bg, k0 == 0, ahead);           \
                        } else {                                                              \
                            DISPATCH(TILES, mt, xb + r0 * ldx, ldx, (const void *)w, stride,  \
                                     kc, yg + r0 * out, out, cols, bg, k0 == 0, ahead);       \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

/* Everywhere: one block (four 4-wide vectors, the width of SSE2 and NEON) by up to 3 rows. */
#define PORTABLE(TILES, mt, ...)                                                              \
    switch (mt) {                                                                             \
    case 1: TILES##_1(__VA_ARGS__); break;                                                    \
    case 2: TILES##_2(__VA_ARGS__); break;                                                    \
    default: TILES##_3(__VA_ARGS__); break;                                                   \
    }
#define TILES3(T, NAME, ...)                                                                  \
    T(NAME, __VA_ARGS__, 1) T(NAME, __VA_ARGS__, 2) T(NAME, __VA_ARGS__, 3)
TILES3(TILE, portable_f32, v4, 4, 4)
TILES3(PAIR_TILE, portable_bf16, v4, u4, 4, 4)
LINEAR(meshlm_linear_f32_portable, f32, BLOCK, 3, PORTABLE, portable_f32, portable_f32)
LINEAR(meshlm_linear_bf16_portable, bf16, BLOCK, 3, PORTABLE, portable_bf16, portable_f32)

#if defined(__x86_64__)
/* AVX-512: two blocks (two 16-wide vectors) by up to 8 rows, 16 accumulators of 32. */
#define WIDE(TILES, mt, ...)                                                                  \
    switch (mt) {                                                                             \
    case 1: TILES##_1(__VA_ARGS__); break;                                                    \
    case 2: TILES##_2(__VA_ARGS__); break;                                                    \
    case 3: TILES##_3(__VA_ARGS__); break;                                                    \
    case 4: TILES##_4(__VA_ARGS__); break;                                                    \
    case 5: TILES##_5(__VA_ARGS__); break;                                                    \
    case 6: TILES##_6(__VA_ARGS__); break;                                                    \
    case 7: TILES##_7(__VA_ARGS__); break;                                                    \
    default: TILES##_8(__VA_ARGS__); break;                                                   \
    }
#define TILES8(T, NAME, ...)                                                                  \
    T(NAME, __VA_ARGS__, 1) T(NAME, __VA_ARGS__, 2) T(NAME, __VA_ARGS__, 3)                   \
    T(NAME, __VA_ARGS__, 4) T(NAME, __VA_ARGS__, 5) T(NAME, __VA_ARGS__, 6)                   \
    T(NAME, __VA_ARGS__, 7) T(NAME, __VA_ARGS__, 8)
#define WIDE_TARGET __attribute__((target("arch=x86-64-v4")))
TILES8(TILE, wide_f32, v16, 16, 2)
TILES8(PAIR_TILE, wide_bf16, v16, u16, 16, 2)
WIDE_TARGET LINEAR(meshlm_linear_f32_wide, f32, (2 * BLOCK), 8, WIDE, wide_f32, wide_f32)
WIDE_TARGET LINEAR(meshlm_linear_bf16_wide, bf16, (2 * BLOCK), 8, WIDE, wide_bf16, wide_f32)

/* AVX2 with FMA (x86-64-v3, where AVX-512 is missing): two blocks (four 8-wide vectors) by up to
 * 3 rows, 12 accumulators of the 16 registers. Against one block by up to 6 rows (the same
 * accumulators), one hidden-512 layer's projections and a 32k-vocabulary head took 2.4
 * against 3.1 ms at one row, 5.2 against 5.9 at 16 and 56 against 59 at 256: two weight
 * streams per group keep more loads in flight; the tiny model's were within 8% either way. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint32_t u8 __attribute__((vector_size(32), aligned(4)));
#define MID(TILES, mt, ...)                                                                   \
    switch (mt) {                                                                             \
    case 1: TILES##_1(__VA_ARGS__); break;                                                    \
    case 2: TILES##_2(__VA_ARGS__); break;                                                    \
    default: TILES##_3(__VA_ARGS__); break;                                                   \
    }
#define MID_TARGET __attribute__((target("arch=x86-64-v3")))
TILES3(TILE, mid_f32, v8, 8, 4)
TILES3(PAIR_TILE, mid_bf16, v8, u8, 8, 4)
MID_TARGET LINEAR(meshlm_linear_f32_avx2, f32, (2 * BLOCK), 3, MID, mid_f32, mid_f32)
MID_TARGET LINEAR(meshlm_linear_bf16_avx2, bf16, (2 * BLOCK), 3, MID, mid_bf16, mid_f32)

/* AVX512_BF16: the rows' activations rounded to bfloat16 pairs once per call (xb: each row's
 * K/2 pairs, a pair one 32-bit word, as the weights' pairs), then tiles of up to 8 rows by two
 * blocks, each pair of inputs one vdpbf16ps per block and row. */
#define DOT_TARGET __attribute__((target("arch=x86-64-v4,avx512bf16")))
#define DOT_TILE(NAME, MT)                                                                    \
    static inline __attribute__((always_inline)) DOT_TARGET void NAME##_##MT(              \
        const uint32_t *xb, int64_t ldx, const bf16_t *w, int64_t stride, int64_t kc,      \
        float *y, int64_t ldy, int cols, const float *bias, int first, struct ahead ahead)  \
    {                                                                                         \
        __m512 acc[MT][2];                                                                    \
        for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();           \
        for (int64_t p = 0; p < (kc + 1) / 2; p++) {                                          \
            fetch_ahead(ahead, p);                                                            \
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * BLOCK);              \
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + stride + p * 2 * BLOCK);     \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                           \
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[m * ldx + p]);        \
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);                              \
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);                              \
            }                                                                                 \
        }                                                                                     \
        STORE(v16, 16, 2, MT)                                                                 \
    }
DOT_TILE(dot, 1) DOT_TILE(dot, 2) DOT_TILE(dot, 3) DOT_TILE(dot, 4)
DOT_TILE(dot, 5) DOT_TILE(dot, 6) DOT_TILE(dot, 7) DOT_TILE(dot, 8)

/* x's rows rounded to bfloat16, to nearest even, into pairs (a zero after an odd K). */
DOT_TARGET static void round_rows(const float *x, int64_t ldx, int64_t rows, int64_t in,
                                  uint32_t *xb, int64_t pairs, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * in > 65536)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = (uint16_t *)(xb + r * pairs);
        for (int64_t k = 0; k < 2 * pairs; k += 16) {
            const int64_t left = in - k;
            const __mmask16 mask =
                left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __m512 v = _mm512_maskz_loadu_ps(mask, x + r * ldx + k);
            const __m256bh h = _mm512_cvtneps_pbh(v);
            const int64_t room = 2 * pairs - k;
            _mm256_mask_storeu_epi16(dst + k, room >= 16 ? 0xffff : (__mmask16)((1u << room) - 1),
                                     (__m256i)h);
        }
    }
}

DOT_TARGET void meshlm_linear_bf16_dot(const float *x, int64_t ldx, int64_t rows, int64_t in,
                                       const bf16_t *packed, const float *bias, float *y,
                                       int64_t out, int threads)
{
    const int64_t pairs = KPAD_bf16(in) / 2, stride = 2 * pairs * BLOCK;
    const int64_t groups = (out + 2 * BLOCK - 1) / (2 * BLOCK);
    uint32_t *xb = malloc((size_t)(rows * pairs) * sizeof *xb);
    if (xb == NULL) { /* no memory for the rounded rows: the exact path */
        meshlm_linear_bf16_wide(x, ldx, rows, in, packed, bias, y, out, threads);
        return;
    }
    round_rows(x, ldx, rows, in, xb, pairs, threads);
    const int64_t blocks = (rows + MC - 1) / MC, items = blocks * groups;
    int64_t counter = 0;
#pragma omp parallel num_threads(threads) if (groups > 1)
    for (int64_t item = claim(&counter), next; item < items; item = next) {
        next = claim(&counter);
        const int64_t b = item / groups, g = item % groups;
        const int64_t b0 = b * rows / blocks, brows = (b + 1) * rows / blocks - b0;
        const int64_t tiles = (brows + 7) / 8;
        const int64_t col = g * 2 * BLOCK;
        const int cols = out - col < 2 * BLOCK ? (int)(out - col) : 2 * BLOCK;
        for (int64_t k0 = 0; k0 < in; k0 += KC) {
            const int64_t kc = in - k0 < KC ? in - k0 : KC;
            const bf16_t *w = packed + (col / BLOCK) * stride + k0 * BLOCK;
            const struct chunk after = next_chunk(packed, sizeof(bf16_t), stride, 2, in, k0, g,
                                                  next < items ? next % groups : -1);
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r0 = b0 + t * brows / tiles;
                WIDE(dot, b0 + (t + 1) * brows / tiles - r0,
                     xb + r0 * pairs + k0 / 2, pairs, w, stride, kc,
                     y + r0 * out + col, out, cols, bias ? bias + col : NULL, k0 == 0,
                     tile_ahead(after, sizeof(bf16_t), stride, 2, t, tiles));
            }
        }
    }
    free(xb);
}

static int has_wide(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

static int has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int has_dot(void)
{
    return has_wide() && __builtin_cpu_supports("avx512bf16");
}

/* meshlm_linear_{f32,bf16} are the AVX-512 kernels where the CPU has it (for bfloat16, the
 * AVX512_BF16 one where it has that too), the portable ones elsewhere, chosen once when the
 * library loads. */
typedef __typeof__(meshlm_linear_f32_portable) linear_f32;
typedef __typeof__(meshlm_linear_bf16_portable) linear_bf16;

static linear_f32 *pick_linear_f32(void)
{
    return has_wide() ? meshlm_linear_f32_wide
           : has_avx2() ? meshlm_linear_f32_avx2 : meshlm_linear_f32_portable;
}

static linear_bf16 *pick_linear_bf16(void)
{
    return has_dot() ? meshlm_linear_bf16_dot
           : has_wide() ? meshlm_linear_bf16_wide
           : has_avx2() ? meshlm_linear_bf16_avx2 : meshlm_linear_bf16_portable;
}

linear_f32 meshlm_linear_f32 __attribute__((ifunc("pick_linear_f32")));
linear_bf16 meshlm_linear_bf16 __attribute__((ifunc("pick_linear_bf16")));

int meshlm_linear_wide(void) { return has_wide(); }
int meshlm_linear_vector(void) { return has_wide() || has_avx2(); }
int meshlm_linear_bf16_rounds(void) { return has_dot(); }
#else
__typeof__(meshlm_linear_f32_portable) meshlm_linear_f32
    __attribute__((alias("meshlm_linear_f32_portable")));
__typeof__(meshlm_linear_bf16_portable) meshlm_linear_bf16
    __attribute__((alias("meshlm_linear_bf16_portable")));

int meshlm_linear_wide(void) { return 0; }
int meshlm_linear_vector(void) { return 0; }
int meshlm_linear_bf16_rounds(void) { return 0; }
#endif
