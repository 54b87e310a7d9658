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
 * Each work item is one panel against a chunk of input rows. It walks the panel front to back (one
 * sequential stream), and for each c multiplies the PANEL weights (PANEL / W vectors) by x[r][c]
 * broadcast, for GROUP input rows at a time: the GROUP * PANEL / W sums stay in registers and no
 * horizontal sum is needed. PANEL and GROUP follow the vector registers the build has (AVX-512, else
 * AVX2's 16).
 *
 * Up to two groups (a small decode step), each group is one pass over the panel, the second reading it
 * from L2. From two rows on, a pass fetches the panel AHEAD inputs ahead into L2 itself: the hardware's
 * prefetchers alone kept too few reads in flight to reach the memory's speed once each input took a few
 * FMAs. More rows go through the panel in blocks of KBLOCK inputs: every group runs over a block (which
 * stays in L1) while the next block is fetched into L2, and the partial sums wait in a small buffer between
 * blocks; the last block fetches the start of the panel this thread will likely take next. The panel is
 * then read from memory once, beside the item's products (a panel read whole by the first group, then
 * again from L2 by the others, left the FMA units idle while the first read). The next block's lines are
 * fetched in address order, each group a contiguous share of them spread evenly over its pass: fetched
 * in the order the products read them (a line of every input's PANEL weights, then the next line of every
 * input), the same lines came at about half the memory's speed, and the products of 32 rows took 1.3x as
 * long; fetched a line per input from each pass's start, 1.05x as long. There x is broadcast by a load
 * (`splat`), leaving the FMA ports to the FMAs; in a one-group pass, bound by its reads, the add form
 * measured faster.
 *
 * Items are handed out dynamically, so a thread that loses its core to another process for a while does
 * not hold the others up beyond the item it is on. Every sum runs over c in order from zero, in float32,
 * whichever path: a row's results are bit for bit the same in any batch, and agree with BLAS to rounding.
 *
 * pdserve_gemm_glu_f32 is SwiGLU's gate/up product with its activation: panels packed by
 * cpu_gemm.pack_glu (gate and up rows interleaved HALF at a time, so panel p holds gate rows
 * [p * HALF, + HALF) and then the same up rows), out [rows, n] = silu(gate) * up with n the intermediate
 * size, a multiple of HALF, and no bias. An item's sums go to a buffer, and from there out gets the
 * activation as cpu_ops.c's silu_mul computes it from the same sums: bit for bit the product then
 * silu_mul, without the [rows, 2n] product in memory. */
#include <immintrin.h>
#include <math.h>
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
#define LINE_FLOATS 16      /* floats in a 64-byte cache line */
#define LINES (PANEL / LINE_FLOATS) /* cache lines per input of a panel */
#define AHEAD 48            /* inputs ahead that a one-group pass fetches into L2 */
#define KBLOCK 64           /* inputs per block past two groups: 64 * PANEL floats, 16 KiB with AVX-512 */
#define HALF (PANEL / 2)    /* gate (and up) rows per panel of the SwiGLU packing */
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

int pdserve_gemm_panel(void) { return PANEL; }

static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }
#include "cpu_splat.h" /* splat: a broadcast, not an add on the FMA ports */
#include "cpu_vexp.h" /* vsilu */

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
        if (R > 1 && c + AHEAD < k)                                                                      \
            for (int l = 0; l < LINES; l++) __builtin_prefetch(panel + (c + AHEAD) * PANEL + l * LINE_FLOATS, 0, 2); \
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

/* Input rows [0, R) of x over inputs [c0, c1) of one panel, their partial sums in sums ([R][PANEL],
 * read back unless c0 is 0). Beside them, the cache lines [0, lines) from `fetch` (NULL where lines is 0)
 * are fetched into L2 in address order, spread evenly over the pass (a line every (c1 - c0) / lines
 * inputs): a fetch that finds every fill buffer taken holds up the products behind it, so fetches in a
 * burst cost more than the same fetches paced at the memory's speed. */
#define DEFINE_BLOCK(R)                                                                                  \
static void block_##R(const float *restrict x, int64_t xs, const float *restrict panel, float *restrict sums, \
                      int64_t c0, int64_t c1, const float *fetch, int64_t lines) {                       \
    vf acc[R][NV];                                                                                       \
    for (int r = 0; r < R; r++)                                                                          \
        for (int v = 0; v < NV; v++) acc[r][v] = c0 ? ld(sums + r * PANEL + v * W) : (vf){0};            \
    const float *f = fetch; /* the next line to fetch */                                                 \
    int64_t due = 0; /* lines owed, in units of 1 / (c1 - c0) line: a line goes out each time it reaches 1 */ \
    for (int64_t c = c0; c < c1; c++) {                                                                  \
        vf wv[NV];                                                                                       \
        for (int v = 0; v < NV; v++) wv[v] = ld(panel + c * PANEL + v * W);                              \
        for (due += lines; due >= c1 - c0; due -= c1 - c0, f += LINE_FLOATS) __builtin_prefetch(f, 0, 2); \
        for (int r = 0; r < R; r++) {                                                                    \
            const vf xb = splat(x[r * xs + c]);                                                         \
            for (int v = 0; v < NV; v++) acc[r][v] += wv[v] * xb;                                        \
        }                                                                                                \
    }                                                                                                    \
    for (int r = 0; r < R; r++)                                                                          \
        for (int v = 0; v < NV; v++) st(sums + r * PANEL + v * W, acc[r][v]);                            \
}
typedef void (*block_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, const float *, int64_t);

/* Both forms for every group size 1..GROUP, indexed by the size. */
#define DEFINE_ROWS(R) DEFINE_GROUP(R) DEFINE_BLOCK(R)
DEFINE_ROWS(1)
DEFINE_ROWS(2)
#if GROUP == 6
DEFINE_ROWS(3)
DEFINE_ROWS(4)
DEFINE_ROWS(5)
DEFINE_ROWS(6)
#define ROWS_TABLE(f) {0, f##_1, f##_2, f##_3, f##_4, f##_5, f##_6}
#else
#define ROWS_TABLE(f) {0, f##_1, f##_2}
#endif
static const group_fn GROUPS[GROUP + 1] = ROWS_TABLE(group);
static const block_fn BLOCKS[GROUP + 1] = ROWS_TABLE(block);

/* Rows [r0, r1) (more than two groups) against panel p, block by block; then bias and the columns that exist.
 * During the last block, the first of `after` (the panel this thread will likely take next, or NULL) is fetched. */
static void item_blocked(const float *x, int64_t xs, const float *panel, const float *bias, float *out, int64_t n,
                         int64_t k, int64_t r0, int64_t r1, int64_t col0, int64_t cols, const float *after) {
    float sums[CHUNK * PANEL] __attribute__((aligned(64)));
    const int64_t groups = (r1 - r0 + GROUP - 1) / GROUP, first = KBLOCK < k ? KBLOCK : k;
    for (int64_t c0 = 0; c0 < k; c0 += KBLOCK) {
        const int64_t c1 = c0 + KBLOCK < k ? c0 + KBLOCK : k;
        /* The next block's lines are fetched into L2 while this one computes: each group a contiguous share. */
        const float *next = c1 < k ? panel + c1 * PANEL : after;
        const int64_t lines = !next ? 0 : (c1 < k ? (k - c1 < KBLOCK ? k - c1 : KBLOCK) : first) * LINES;
        const int64_t share = (lines + groups - 1) / groups;
        for (int64_t g = r0, i = 0; g < r1; g += GROUP, i++) {
            const int64_t size = r1 - g < GROUP ? r1 - g : GROUP;
            const int64_t from = i * share < lines ? i * share : lines;
            const int64_t count = lines - from < share ? lines - from : share;
            BLOCKS[size](x + g * xs, xs, panel, sums + (g - r0) * PANEL, c0, c1, count ? next + from * LINE_FLOATS : NULL,
                         count);
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *s = sums + (r - r0) * PANEL;
        float *o = out + r * n + col0;
        for (int64_t i = 0; i < cols; i++) o[i] = bias ? s[i] + bias[col0 + i] : s[i];
    }
}

int pdserve_gemm_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *out,
                     int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 1 || n < 1 || k < 1) return -1;
    const int64_t npanels = (n + PANEL - 1) / PANEL, nchunks = (rows + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < npanels * nchunks; item++) {
        const int64_t p = item % npanels, r0 = item / npanels * CHUNK;
        const int64_t r1 = r0 + CHUNK < rows ? r0 + CHUNK : rows;
        const int64_t col0 = p * PANEL, cols = n - col0 < PANEL ? n - col0 : PANEL;
        if (r1 - r0 > 2 * GROUP) {
            /* Items go out in order, one at a time, to whichever thread is free: with every thread busy,
             * this one's next is most often num_threads further on. */
            const int64_t guess = item + num_threads;
            const float *after = guess < npanels * nchunks ? panels + guess % npanels * k * PANEL : NULL;
            item_blocked(x, x_stride, panels + p * k * PANEL, bias, out, n, k, r0, r1, col0, cols, after);
            continue;
        }
        for (int64_t g = r0; g < r1; g += GROUP) {
            const int64_t size = r1 - g < GROUP ? r1 - g : GROUP;
            GROUPS[size](x + g * x_stride, x_stride, panels + p * k * PANEL, bias, out + g * n, n, k, col0, cols);
        }
    }
    return 0;
}

/* SwiGLU (the header comment): each item's product to `prod` (its rows PANEL apart), then the activation. */
int pdserve_gemm_glu_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *out,
                         int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 1 || n < 1 || k < 1 || n % HALF || bias) return -1;
    const int64_t npanels = n / HALF, nchunks = (rows + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < npanels * nchunks; item++) {
        float prod[CHUNK * PANEL] __attribute__((aligned(64)));
        const int64_t p = item % npanels, r0 = item / npanels * CHUNK;
        const int64_t m = r0 + CHUNK < rows ? CHUNK : rows - r0;
        const float *panel = panels + p * k * PANEL, *xr = x + r0 * x_stride;
        if (m > 2 * GROUP) {
            const int64_t guess = item + num_threads;
            const float *after = guess < npanels * nchunks ? panels + guess % npanels * k * PANEL : NULL;
            item_blocked(xr, x_stride, panel, NULL, prod, PANEL, k, 0, m, 0, PANEL, after);
        } else {
            for (int64_t g = 0; g < m; g += GROUP) {
                const int64_t size = m - g < GROUP ? m - g : GROUP;
                GROUPS[size](xr + g * x_stride, x_stride, panel, NULL, prod + g * PANEL, PANEL, k, 0, PANEL);
            }
        }
        for (int64_t r = 0; r < m; r++) {
            const float *s = prod + r * PANEL;
            float *o = out + (r0 + r) * n + p * HALF;
            for (int64_t j = 0; j < HALF; j += W) st(o + j, vsilu(ld(s + j)) * ld(s + HALF + j));
        }
    }
    return 0;
}
