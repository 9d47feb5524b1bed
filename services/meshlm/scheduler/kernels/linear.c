/* y = x W^T + b in float32 on the CPU, over a weight packed once in 16-column blocks: block j
 * holds W's rows 16j..16j+15 transposed, [K][16], so one aligned run of 16 floats is one
 * input's weights into 16 outputs; the blocks run to a multiple of 32 columns, the padding
 * zero (`NativePacking` in models/cpu_linear.py packs them).
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

typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* The tile of MT rows by NV vectors of LANES columns: weights w at the tile's first column
 * and input k0 (blocks `stride` floats apart), inputs x (rows ldx apart), kc inputs; writes
 * (first chunk: bias + sum) or adds (later chunks) its `cols` valid columns at y. */
#define TILE(NAME, V, LANES, NV, MT)                                                         \
    static inline __attribute__((always_inline)) void NAME##_##MT(                          \
        const float *x, int64_t ldx, const float *w, int64_t stride, int64_t kc, float *y,  \
        int64_t ldy, int cols, const float *bias, int first)                                \
    {                                                                                         \
        V acc[MT][NV];                                                                        \
        for (int m = 0; m < MT; m++)                                                          \
            for (int j = 0; j < NV; j++) acc[m][j] = (V){0};                                  \
        for (int64_t k = 0; k < kc; k++) {                                                    \
            V b[NV];                                                                          \
            for (int j = 0; j < NV; j++)                                                      \
                b[j] = *(const V *)(w + (j * LANES / BLOCK) * stride + k * BLOCK              \
                                    + j * LANES % BLOCK);                                     \
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
 * thread's unit of work. */
#define LINEAR(NAME, GROUP, MAXROWS, DISPATCH)                                                \
    void NAME(const float *x, int64_t ldx, int64_t rows, int64_t in, const float *packed,    \
              const float *bias, float *y, int64_t out, int threads)                          \
    {                                                                                         \
        const int64_t groups = (out + GROUP - 1) / GROUP;                                     \
        const int64_t tiles = (rows + MAXROWS - 1) / MAXROWS;                                 \
        const int64_t stride = in * BLOCK;                                                    \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (groups > 1)")     \
        for (int64_t g = 0; g < groups; g++) {                                                \
            const int64_t col = g * GROUP;                                                    \
            const int cols = out - col < GROUP ? (int)(out - col) : GROUP;                    \
            for (int64_t k0 = 0; k0 < in; k0 += KC) {                                         \
                const int64_t kc = in - k0 < KC ? in - k0 : KC;                               \
                const float *w = packed + (col / BLOCK) * stride + k0 * BLOCK;                \
                for (int64_t t = 0; t < tiles; t++) {                                         \
                    const int64_t r0 = t * rows / tiles, mt = (t + 1) * rows / tiles - r0;    \
                    DISPATCH(mt, x + r0 * ldx + k0, ldx, w, stride, kc, y + r0 * out + col,   \
                             out, cols, bias ? bias + col : NULL, k0 == 0);                   \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

/* Everywhere: one block (four 4-wide vectors, the width of SSE2 and NEON) by up to 3 rows. */
TILE(portable, v4, 4, 4, 1)
TILE(portable, v4, 4, 4, 2)
TILE(portable, v4, 4, 4, 3)
#define PORTABLE(mt, ...)                                                                     \
    switch (mt) {                                                                             \
    case 1: portable_1(__VA_ARGS__); break;                                                   \
    case 2: portable_2(__VA_ARGS__); break;                                                   \
    default: portable_3(__VA_ARGS__); break;                                                  \
    }
LINEAR(meshlm_linear_f32_portable, BLOCK, 3, PORTABLE)

#if defined(__x86_64__)
/* AVX-512: two blocks (two 16-wide vectors) by up to 8 rows, 16 accumulators of 32. */
TILE(wide, v16, 16, 2, 1)
TILE(wide, v16, 16, 2, 2)
TILE(wide, v16, 16, 2, 3)
TILE(wide, v16, 16, 2, 4)
TILE(wide, v16, 16, 2, 5)
TILE(wide, v16, 16, 2, 6)
TILE(wide, v16, 16, 2, 7)
TILE(wide, v16, 16, 2, 8)
#define WIDE(mt, ...)                                                                         \
    switch (mt) {                                                                             \
    case 1: wide_1(__VA_ARGS__); break;                                                       \
    case 2: wide_2(__VA_ARGS__); break;                                                       \
    case 3: wide_3(__VA_ARGS__); break;                                                       \
    case 4: wide_4(__VA_ARGS__); break;                                                       \
    case 5: wide_5(__VA_ARGS__); break;                                                       \
    case 6: wide_6(__VA_ARGS__); break;                                                       \
    case 7: wide_7(__VA_ARGS__); break;                                                       \
    default: wide_8(__VA_ARGS__); break;                                                      \
    }
__attribute__((target("arch=x86-64-v4")))
LINEAR(meshlm_linear_f32_wide, (2 * BLOCK), 8, WIDE)

static int has_wide(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

typedef __typeof__(meshlm_linear_f32_portable) linear_f32;

static linear_f32 *pick_linear_f32(void)
{
    return has_wide() ? meshlm_linear_f32_wide : meshlm_linear_f32_portable;
}

/* meshlm_linear_f32 is the AVX-512 kernel where the CPU has it, the portable one elsewhere,
 * chosen once when the library loads. */
linear_f32 meshlm_linear_f32 __attribute__((ifunc("pick_linear_f32")));

int meshlm_linear_wide(void) { return has_wide(); }
#else
__typeof__(meshlm_linear_f32_portable) meshlm_linear_f32
    __attribute__((alias("meshlm_linear_f32_portable")));

int meshlm_linear_wide(void) { return 0; }
#endif
