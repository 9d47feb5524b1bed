/* y = x W^T + b on the CPU, x and y float32, over a weight packed once in 16-column blocks:
 * block j holds W's rows 16j..16j+15 transposed, [K][16], so one aligned run of 16 elements
 * is one input's weights into 16 outputs; the blocks run to a multiple of 32 columns, the
 * padding zero (`NativePacking` in models/cpu_linear.py packs them). The weights are float32
 * (meshlm_linear_f32) or bfloat16 (meshlm_linear_bf16: half the bytes to read, each weight
 * widened to float32 exactly as it is loaded, the arithmetic float32).
 *
 * A decode step multiplies a few rows by every weight of the model, so it is bound by reading
 * the weights: each block is read once per step and every row of the step is multiplied
 * against it while it is in cache, the rows' partial sums held in registers. On this
 * project's 2-core AVX-512 machine that reads the bench model's weights at 49 GB/s at one
 * row, where oneDNN's packed kernels read them at 29 (2.1 ms a pass against 3.5), and keeps
 * level with them from 64 rows to prompt chunks of 2048 (both at 220 GFLOP/s).
 *
 * Work is shared among torch's OpenMP threads by column groups; K is taken in chunks of
 * KC so that a group's chunk of weights stays in cache while every tile of rows reads it.
 * Built with the other kernels by kernels/native.py. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 16   /* columns per packed block */
#define KC 512     /* inputs per pass over the rows */
#define STAGE_TILES 3  /* row tiles up to which non-float32 weights are widened in each */

typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h4 __attribute__((vector_size(8), aligned(2)));
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u4 __attribute__((vector_size(16)));
typedef uint32_t u16 __attribute__((vector_size(64)));

/* One weight as float32 (a bfloat16 shifted into the high half), and LANES of them from p. */
static inline float widen_bf16(uint16_t w)
{
    union { uint32_t u; float f; } bits = { .u = (uint32_t)w << 16 };
    return bits.f;
}
#define WIDEN_f32(w) (w)
#define WIDEN_bf16(w) widen_bf16(w)
#define LOAD_f32(V, LANES, p) (*(const V *)(p))
#define LOAD_bf16(V, LANES, p) ((V)(__builtin_convertvector(*(const h##LANES *)(p), u##LANES) << 16))

/* The tile of MT rows by NV vectors of LANES columns: weights w (of type W) at the tile's
 * first column and input k0 (blocks `stride` elements apart), inputs x (rows ldx apart), kc inputs; writes
 * (first chunk: bias + sum) or adds (later chunks) its `cols` valid columns at y. */
#define TILE(NAME, W, V, LANES, NV, MT)                                                      \
    static inline __attribute__((always_inline)) void NAME##_##MT(                          \
        const float *x, int64_t ldx, const W##_t *w, int64_t stride, int64_t kc, float *y,  \
        int64_t ldy, int cols, const float *bias, int first)                                \
    {                                                                                         \
        V acc[MT][NV];                                                                        \
        for (int m = 0; m < MT; m++)                                                          \
            for (int j = 0; j < NV; j++) acc[m][j] = (V){0};                                  \
        for (int64_t k = 0; k < kc; k++) {                                                    \
            V b[NV];                                                                          \
            for (int j = 0; j < NV; j++)                                                      \
                b[j] = LOAD_##W(V, LANES, w + (j * LANES / BLOCK) * stride + k * BLOCK        \
                                             + j * LANES % BLOCK);                            \
            _Pragma("GCC unroll 16") for (int m = 0; m < MT; m++) {                          \
                const float xv = x[m * ldx + k];                                              \
                for (int j = 0; j < NV; j++) acc[m][j] += xv * b[j];                          \
            }                                                                                 \
        }                                                                                     \
        for (int m = 0; m < MT; m++) {                                                        \
            float *row = y + m * ldy;                                                         \
            if (cols == NV * LANES) {                                                         \
                for (int j = 0; j < NV; j++) {                                                \
                    V *out = (V *)(row + j * LANES);                                          \
                    if (!first) *out += acc[m][j];                                            \
                    else if (bias) *out = acc[m][j] + *(const V *)(bias + j * LANES);         \
                    else *out = acc[m][j];                                                    \
                }                                                                             \
            } else {                                                                          \
                float sums[NV * LANES];                                                       \
                memcpy(sums, acc[m], sizeof sums);                                            \
                for (int c = 0; c < cols; c++)                                                \
                    row[c] = (first ? (bias ? bias[c] : 0.f) : row[c]) + sums[c];             \
            }                                                                                 \
        }                                                                                     \
    }

/* The multiply over tiles of at most MAXROWS rows (split evenly) and GROUP columns per
 * thread's unit of work. Weights that are not float32 are widened as a tile loads them where
 * up to STAGE_TILES tiles cover the rows; where there are more, each chunk of them is widened
 * once into a float32 buffer that every tile then reads (FTILES: the float32 tiles). Measured
 * on the bench model's projections, bfloat16 against float32 on AVX-512: per tile 0.80x at 64
 * rows and 0.79x at 256, through the buffer 0.92x and 0.98x; the two level at 32 rows. */
#define LINEAR(NAME, W, GROUP, MAXROWS, DISPATCH, TILES, FTILES)                             \
    void NAME(const float *x, int64_t ldx, int64_t rows, int64_t in, const W##_t *packed,    \
              const float *bias, float *y, int64_t out, int threads)                          \
    {                                                                                         \
        const int64_t groups = (out + GROUP - 1) / GROUP;                                     \
        const int64_t tiles = (rows + MAXROWS - 1) / MAXROWS;                                 \
        const int64_t stride = in * BLOCK;                                                    \
        const int staged = sizeof(W##_t) != sizeof(float) && tiles > STAGE_TILES;             \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (groups > 1)")     \
        for (int64_t g = 0; g < groups; g++) {                                                \
            const int64_t col = g * GROUP;                                                    \
            const int cols = out - col < GROUP ? (int)(out - col) : GROUP;                    \
            float buffer[staged ? GROUP * KC : 1];                                            \
            for (int64_t k0 = 0; k0 < in; k0 += KC) {                                         \
                const int64_t kc = in - k0 < KC ? in - k0 : KC;                               \
                const W##_t *w = packed + (col / BLOCK) * stride + k0 * BLOCK;                \
                float *yg = y + col;                                                          \
                const float *bg = bias ? bias + col : NULL;                                   \
                if (staged) {                                                                 \
                    for (int64_t b = 0; b < GROUP / BLOCK; b++)                               \
                        for (int64_t i = 0; i < kc * BLOCK; i++)                              \
                            buffer[b * kc * BLOCK + i] = WIDEN_##W(w[b * stride + i]);        \
                    for (int64_t t = 0; t < tiles; t++) {                                     \
                        const int64_t r0 = t * rows / tiles;                                  \
                        DISPATCH(FTILES, (t + 1) * rows / tiles - r0, x + r0 * ldx + k0, ldx, \
                                 buffer, kc * BLOCK, kc, yg + r0 * out, out, cols, bg,        \
                                 k0 == 0);                                                    \
                    }                                                                         \
                    continue;                                                                 \
                }                                                                             \
                for (int64_t t = 0; t < tiles; t++) {                                         \
                    const int64_t r0 = t * rows / tiles;                                      \
                    DISPATCH(TILES, (t + 1) * rows / tiles - r0, x + r0 * ldx + k0, ldx, w,   \
                             stride, kc, yg + r0 * out, out, cols, bg, k0 == 0);              \
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
#define PORTABLE_LINEAR(W)                                                                    \
    TILE(portable_##W, W, v4, 4, 4, 1)                                                        \
    TILE(portable_##W, W, v4, 4, 4, 2)                                                        \
    TILE(portable_##W, W, v4, 4, 4, 3)                                                        \
    LINEAR(meshlm_linear_##W##_portable, W, BLOCK, 3, PORTABLE, portable_##W, portable_f32)

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
#define WIDE_LINEAR(W)                                                                        \
    TILE(wide_##W, W, v16, 16, 2, 1) TILE(wide_##W, W, v16, 16, 2, 2)                         \
    TILE(wide_##W, W, v16, 16, 2, 3) TILE(wide_##W, W, v16, 16, 2, 4)                         \
    TILE(wide_##W, W, v16, 16, 2, 5) TILE(wide_##W, W, v16, 16, 2, 6)                         \
    TILE(wide_##W, W, v16, 16, 2, 7) TILE(wide_##W, W, v16, 16, 2, 8)                         \
    __attribute__((target("arch=x86-64-v4")))                                                 \
    LINEAR(meshlm_linear_##W##_wide, W, (2 * BLOCK), 8, WIDE, wide_##W, wide_f32)

typedef float f32_t;
typedef uint16_t bf16_t;

PORTABLE_LINEAR(f32)
PORTABLE_LINEAR(bf16)

#if defined(__x86_64__)
WIDE_LINEAR(f32)
WIDE_LINEAR(bf16)

static int has_wide(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

/* meshlm_linear_{f32,bf16} are the AVX-512 kernels where the CPU has it, the portable ones
 * elsewhere, chosen once when the library loads. */
typedef __typeof__(meshlm_linear_f32_portable) linear_f32;
typedef __typeof__(meshlm_linear_bf16_portable) linear_bf16;

static linear_f32 *pick_linear_f32(void)
{
    return has_wide() ? meshlm_linear_f32_wide : meshlm_linear_f32_portable;
}

static linear_bf16 *pick_linear_bf16(void)
{
    return has_wide() ? meshlm_linear_bf16_wide : meshlm_linear_bf16_portable;
}

linear_f32 meshlm_linear_f32 __attribute__((ifunc("pick_linear_f32")));
linear_bf16 meshlm_linear_bf16 __attribute__((ifunc("pick_linear_bf16")));

int meshlm_linear_wide(void) { return has_wide(); }
#else
__typeof__(meshlm_linear_f32_portable) meshlm_linear_f32
    __attribute__((alias("meshlm_linear_f32_portable")));
__typeof__(meshlm_linear_bf16_portable) meshlm_linear_bf16
    __attribute__((alias("meshlm_linear_bf16_portable")));

int meshlm_linear_wide(void) { return 0; }
#endif
