/* float32 matrix products on the CPU through a weight packed in panels: out = x @ w.T (+ bias).
 *
 * Contract (checked by engine/kernels/cpu_gemm.py before every call):
 *   x      [rows, k] float32, row stride x_stride (elements), each row's k values contiguous;
 *   panels [ceil(n / PANEL)][k][PANEL] float32, contiguous: panel p holds weight rows
 *          [p * PANEL, p * PANEL + PANEL) transposed, so that for each c the PANEL weights
 *          w[p * PANEL + i][c] are adjacent (rows past n are zeros);
 *   bias   [n] float32 or NULL;
 *   out    [rows, n] float32, contiguous; rows >= 1.
 *
 * Each work item is one panel against a chunk of input rows. It walks the panel once, front to back
 * (one sequential stream, which the hardware prefetchers follow at the memory's full read speed),
 * and for each c multiplies the PANEL weights (PANEL / W vectors) by x[r][c] broadcast, for GROUP
 * input rows at a time: the GROUP * PANEL / W sums stay in registers and no horizontal sum is needed.
 * PANEL and GROUP follow the vector registers the build has (AVX-512, else AVX2's 16).
 * A few rows (a decode step) read every weight once at about the memory's speed; many rows (a
 * prefill) reread a panel from L2 once per group, and the products run at about the FMA units'
 * speed. Items are handed out dynamically, so a thread that loses its core to another process for a
 * while does not hold the others up beyond the item it is on. Sums run over c in order, in float32:
 * results agree with BLAS to rounding. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__          /* 32 vector registers of 16 floats */
#define W 16                /* floats per vector */
#define PANEL 64            /* weight rows per panel: 4 vectors */
#define GROUP 6             /* input rows per pass over a panel: 24 sums in registers */
#else                       /* AVX2: 16 registers of 8 floats */
#define W 8
#define PANEL 32
#define GROUP 2             /* 8 sums, 4 weight vectors and a broadcast: 13 registers */
#endif
#define NV (PANEL / W)
#define CHUNK (8 * GROUP)   /* input rows per work item */
typedef float vf __attribute__((vector_size(W * sizeof(float))));

int pdserve_gemm_panel(void) { return PANEL; }

static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Input rows [0, R) of x against panel p; their outputs' columns [p * PANEL, + cols). */
#define DEFINE_GROUP(R)                                                                                  \
static void group_##R(const float *restrict x, int64_t xs, const float *restrict panel,                 \
                      const float *restrict bias, float *restrict out, int64_t n, int64_t k,             \
                      int64_t col0, int64_t cols) {                                                      \
    vf acc[R][NV];                                                                                       \
    for (int r = 0; r < R; r++)                                                                          \
        for (int v = 0; v < NV; v++) acc[r][v] = (vf){0};                                                \
    for (int64_t c = 0; c < k; c++) {                                                                    \
        vf wv[NV];                                                                                       \
        for (int v = 0; v < NV; v++) wv[v] = ld(panel + c * PANEL + v * W);                              \
        for (int r = 0; r < R; r++) {                                                                    \
            const vf xb = (vf){0} + x[r * xs + c];                                                       \
            for (int v = 0; v < NV; v++) acc[r][v] += wv[v] * xb;                                        \
        }                                                                                                \
    }                                                                                                    \
    for (int r = 0; r < R; r++) {                                                                        \
        float *o = out + r * n + col0;                                                                   \
        if (cols == PANEL) {                                                                             \
            for (int v = 0; v < NV; v++) st(o + v * W, bias ? acc[r][v] + ld(bias + col0 + v * W) : acc[r][v]); \
        } else { /* the last panel: only the columns that exist */                                      \
            for (int64_t i = 0; i < cols; i++) o[i] = acc[r][i / W][i % W] + (bias ? bias[col0 + i] : 0.0f); \
        }                                                                                                \
    }                                                                                                    \
}
typedef void (*group_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t,
                         int64_t, int64_t);
DEFINE_GROUP(1)
DEFINE_GROUP(2)
#if GROUP == 6
DEFINE_GROUP(3)
DEFINE_GROUP(4)
DEFINE_GROUP(5)
DEFINE_GROUP(6)
static const group_fn GROUPS[GROUP + 1] = {0, group_1, group_2, group_3, group_4, group_5, group_6};
#else
static const group_fn GROUPS[GROUP + 1] = {0, group_1, group_2};
#endif

int pdserve_gemm_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *out,
                     int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 1 || n < 1 || k < 1) return -1;
    const int64_t npanels = (n + PANEL - 1) / PANEL, nchunks = (rows + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < npanels * nchunks; item++) {
        const int64_t p = item % npanels, r0 = item / npanels * CHUNK;
        const int64_t r1 = r0 + CHUNK < rows ? r0 + CHUNK : rows;
        const int64_t col0 = p * PANEL, cols = n - col0 < PANEL ? n - col0 : PANEL;
        for (int64_t g = r0; g < r1; g += GROUP) {
            const int64_t size = r1 - g < GROUP ? r1 - g : GROUP;
            GROUPS[size](x + g * x_stride, x_stride, panels + p * k * PANEL, bias, out + g * n, n, k, col0, cols);
        }
    }
    return 0;
}
