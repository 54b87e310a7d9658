/* Skinny float32 matrix product on the CPU: out = x @ w.T (+ bias) for a few rows of x.
 *
 * Contract (checked by engine/kernels/cpu_skinny.py before every call):
 *   x    [rows, k] float32, row stride x_stride (elements), each row's k values contiguous;
 *   w    [n, k] float32, contiguous (a linear layer's weight as it is stored);
 *   bias [n] float32 or NULL;
 *   out  [rows, n] float32, contiguous;
 *   1 <= rows <= MAX_ROWS. Returns 0 when done, -1 (nothing written) for a row count outside that.
 *
 * With a few rows the product reads each weight once and does little arithmetic per byte, so it is
 * bound by how fast the weights stream from memory. BLAS libraries tuned for large products reach a
 * fraction of that here. This kernel streams them: each OpenMP thread takes a contiguous range of
 * weight rows and reads them a tile of NT rows at a time, in vectors of W floats, multiplying each
 * against the input rows (few enough to stay in L1/L2) in groups of at most GROUP: a tile read for
 * the first group is in L1 for the next. The group's row count is a compile-time constant in each
 * instantiation, so its NT * rows vector accumulators live in registers. The k tail (k not a multiple
 * of W) runs in scalar code. Sums are in float32, in a different order from BLAS: results agree to
 * rounding. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 16
#define GROUP 8 /* input rows per pass over a tile */
#define W 8
typedef float vf __attribute__((vector_size(W * sizeof(float))));

int pdserve_skinny_max_rows(void) { return MAX_ROWS; }

static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(vf v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}

/* Weight rows [j, j + nt), nt <= NT, against R input rows. With NT rows read at once (NT streams) and,
 * when ``next`` is given, the next tile's rows prefetched (a line of each per 16 floats), enough cache
 * misses stay in flight to approach the memory's bandwidth from one core; each input vector loaded
 * serves all NT rows. The NT * R accumulators (at most 32) stay in registers. */
#define DEFINE_TILE(R, NT)                                                                               \
static void tile_##R##_##NT(const float *restrict x, int64_t xs, const float *restrict w,               \
                            const float *restrict bias, float *restrict out, int64_t n, int64_t k,       \
                            int64_t j, int nt, const float *next) {                                      \
    const int64_t kv = k - k % W;                                                                        \
    vf acc[NT][R];                                                                                       \
    for (int i = 0; i < NT; i++)                                                                         \
        for (int r = 0; r < R; r++) acc[i][r] = (vf){0};                                                 \
    if (nt == NT) { /* a full tile: constant trip counts, unrolled */                                   \
        for (int64_t c = 0; c < kv; c += W) {                                                            \
            vf xv[R];                                                                                    \
            for (int r = 0; r < R; r++) xv[r] = ld(x + r * xs + c);                                      \
            if (next && !(c & 15))                                                                       \
                for (int i = 0; i < NT; i++) __builtin_prefetch(next + i * k + c);                       \
            for (int i = 0; i < NT; i++) {                                                               \
                const vf wv = ld(w + (j + i) * k + c);                                                   \
                for (int r = 0; r < R; r++) acc[i][r] += wv * xv[r];                                     \
            }                                                                                            \
        }                                                                                                \
    } else { /* a range's last, partial tile */                                                         \
        for (int64_t c = 0; c < kv; c += W) {                                                            \
            vf xv[R];                                                                                    \
            for (int r = 0; r < R; r++) xv[r] = ld(x + r * xs + c);                                      \
            for (int i = 0; i < nt; i++) {                                                               \
                const vf wv = ld(w + (j + i) * k + c);                                                   \
                for (int r = 0; r < R; r++) acc[i][r] += wv * xv[r];                                     \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int i = 0; i < nt; i++) {                                                                       \
        const float *wr = w + (j + i) * k;                                                               \
        for (int r = 0; r < R; r++) {                                                                    \
            float s = hsum(acc[i][r]);                                                                   \
            for (int64_t c = kv; c < k; c++) s += wr[c] * x[r * xs + c];                                 \
            out[r * n + j + i] = bias ? s + bias[j + i] : s;                                             \
        }                                                                                                \
    }                                                                                                    \
}
/* Alone (rows <= GROUP), each row count with the widest tile its registers allow. */
DEFINE_TILE(1, 16)
DEFINE_TILE(2, 8)
DEFINE_TILE(3, 8)
DEFINE_TILE(4, 6)
DEFINE_TILE(5, 4)
DEFINE_TILE(6, 4)
DEFINE_TILE(7, 4)
DEFINE_TILE(8, 4)
/* After a group of GROUP rows (rows > GROUP): the remainder, on that group's tile of 4. */
DEFINE_TILE(1, 4)
DEFINE_TILE(2, 4)
DEFINE_TILE(3, 4)
DEFINE_TILE(4, 4)

typedef void (*tile_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t,
                        int64_t, int, const float *);
static const tile_fn ALONE[GROUP + 1] = {0, tile_1_16, tile_2_8, tile_3_8, tile_4_6,
                                         tile_5_4, tile_6_4, tile_7_4, tile_8_4};
static const int ALONE_NT[GROUP + 1] = {0, 16, 8, 8, 6, 4, 4, 4, 4};
static const tile_fn AFTER[GROUP + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4,
                                         tile_5_4, tile_6_4, tile_7_4, tile_8_4};

/* Weight rows [n0, n1) against every input row, tile by tile. */
static void range(const float *x, int64_t xs, const float *w, const float *bias, float *out, int64_t rows,
                  int64_t n, int64_t k, int64_t n0, int64_t n1) {
    const int tile = rows <= GROUP ? ALONE_NT[rows] : 4;
    for (int64_t j = n0; j < n1; j += tile) {
        const int nt = n1 - j < tile ? (int)(n1 - j) : tile;
        /* Prefetch the next tile only while it is in this range (the prefetch is only a hint, but
         * past the weight's end it would fetch memory the call does not own). */
        const float *next = j + 2 * tile <= n1 ? w + (j + tile) * k : NULL;
        for (int64_t g = 0; g < rows; g += GROUP) {
            const int64_t size = rows - g < GROUP ? rows - g : GROUP;
            const tile_fn fn = rows <= GROUP ? ALONE[size] : AFTER[size];
            /* The tile's first group brings it in; the others find it in L1. */
            fn(x + g * xs, xs, w, bias, out + g * n, n, k, j, nt, g == 0 ? next : NULL);
        }
    }
}

int pdserve_skinny_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                       int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    /* An even split in whole blocks of 48 weight rows (a multiple of every tile), one contiguous
     * range per thread. */
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t blocks = (n + 47) / 48;
        const int64_t n0 = 48 * (blocks * t / nt), end = 48 * (blocks * (t + 1) / nt);
        const int64_t n1 = end < n ? end : n;
        if (n0 < n1) range(x, x_stride, w, bias, out, rows, n, k, n0, n1);
    }
    return 0;
}
