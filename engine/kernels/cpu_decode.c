/* Paged decode attention on the CPU, reading K/V in place from the cache blocks.
 *
 * Contract (checked by engine/kernels/cpu_decode.py before every call):
 *   q      [batch, num_kv_heads * group, head_dim] of the cache's element type, a sequence's rows q_stride
 *          elements apart, its heads' rows adjacent;
 *   k, v   caches addressed as base + block * block_stride + offset * token_stride + head * head_stride,
 *          each head's head_dim elements contiguous;
 *   blocks [batch, max_blocks] int64: sequence b's position p lives in block blocks[b][p / block_size];
 *   positions starts[b] <= p < spans[b] are attended (a window or a cascade's suffix starts past 0);
 *   out    [batch, num_kv_heads * group, head_dim] of the cache's element type (bfloat16 rounded to
 *          nearest even), lse [batch, num_kv_heads * group] float32 (natural log-sum-exp of the scaled
 *          scores; -inf and a zero row where no position is read);
 *   init_out, init_lse: NULL, or the same rows' attention over other keys (a cascade's shared prefix):
 *          query head g of KV head h of sequence b at init_out + b * is[0] + h * is[1] + g * is[2] (head_dim
 *          contiguous values, float32 where init_f32, else of the cache's type) and its log-sum-exp at
 *          init_lse + b * ls[0] + h * ls[1] + g * ls[2]; the result is then over the union of both key sets
 *          (the two merged exactly). Strides let a caller pass the prefix part where it lies.
 * group <= MAX_GROUP, and head_dim one of the sizes HEAD_SIZES instantiates (pdserve_supports_head_dim);
 * the entry points return -1 without reading anything otherwise, 0 when done.
 *
 * One sequence and a run of its KV heads per OpenMP iteration (DEFINE_DECODE); each head's query heads
 * (its GQA group) share each K/V row it loads. Keys go in tiles of one vector (TILE = W: 16 floats with
 * AVX-512, else 8) with an online softmax, accumulated in float32; a bfloat16 cache's dot products go by
 * pairs where the CPU has AVX512-BF16 (dot_pairs). Vectors are GCC/Clang vector
 * extensions, lowered to whatever SIMD the CPU has (-march=native).
 * The OpenMP runtime is the one torch already loaded (same soname), so these threads are torch's
 * intra-op threads. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_ITEM_HEADS 16 /* query heads per work item */
#define MAX_HEAD_DIM 256
#ifdef __AVX512F__
#define W 16 /* floats per vector */
#else
#define W 8
#endif
#define TILE W /* keys per tile: one vector of scores per query head */
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));

int pdserve_max_group(void) { return MAX_GROUP; }
int pdserve_max_head_dim(void) { return MAX_HEAD_DIM; }
int pdserve_decode_lanes(void) { return W; }

#include "cpu_splat.h" /* splat: a broadcast (the kernel took 1.08-1.11x as long with the add, keys in the cache) */
static inline vf ld_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
#include "cpu_bf16.h" /* widen: a K/V row's bfloat16 lanes; vbf16: the output's rounding */
static inline vf ld_bf16(const uint16_t *p) { vh h; memcpy(&h, p, sizeof h); return widen(h); }
static inline void st_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline void st_bf16(uint16_t *p, vf v) { const vh h = vbf16(v); memcpy(p, &h, sizeof h); }

static inline vf vmax(vf a, vf b) { vi m = a > b; return (vf)(((vi)a & m) | ((vi)b & ~m)); }

#if W == 16
#include "cpu_lanes.h" /* LANES, hsum, hmax; LOn / HIn: the lanes each level of reduce()'s tree pairs up */
/* reduce() leaves in lane i the sum of p[BITREV[i]]: a key's partial sums go in at its bit-reversed slot. */
static const int BITREV[W] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
/* The lane sums of W vectors at once, by a tree of pairwise half-swaps: 2 shuffles and an add per
 * pair per level, against a whole halving per vector. */
#define PAIR_SUM(x, y, LO, HI) (__builtin_shufflevector(x, y, LO) + __builtin_shufflevector(x, y, HI))
static inline vf reduce(const vf *p) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = PAIR_SUM(p[2 * i], p[2 * i + 1], LO8, HI8);
    for (int i = 0; i < 4; i++) b[i] = PAIR_SUM(a[2 * i], a[2 * i + 1], LO4, HI4);
    for (int i = 0; i < 2; i++) c[i] = PAIR_SUM(b[2 * i], b[2 * i + 1], LO2, HI2);
    return PAIR_SUM(c[0], c[1], LO1, HI1);
}
#else
static const vi LANES = {0, 1, 2, 3, 4, 5, 6, 7};
static const int BITREV[W] = {0, 4, 2, 6, 1, 5, 3, 7};
static inline float hsum(vf v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}
static inline float hmax(vf v) {
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}
static inline vf reduce(const vf *p) {
    vf a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(b[0], b[1], 0, 8, 2, 10, 4, 12, 6, 14)
         + __builtin_shufflevector(b[0], b[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

/* bfloat16 dot products by pairs (AVX512-BF16's vdpbf16ps: 32 products summed into 16 float32 lanes
 * per instruction, each product exact), for a bfloat16 cache: half the instructions of widening K to
 * float32 first. Elsewhere stubs that nothing calls (BF16_PAIRS 0). */
#if defined(__AVX512BF16__) && W == 16
#define BF16_PAIRS 1
typedef __m512bh vb;
static inline vb ld_pairs(const uint16_t *p) { return (vb)_mm512_loadu_si512(p); }
static inline vf dot_pairs(const vb *qb, const uint16_t *k, int n2) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < n2; c++) a = _mm512_dpbf16_ps(a, qb[c], ld_pairs(k + 32 * c));
    return (vf)a;
}
#else
#define BF16_PAIRS 0
typedef vf vb;
static inline vb ld_pairs(const uint16_t *p) { (void)p; return (vb){}; }
static inline vf dot_pairs(const vb *qb, const uint16_t *k, int n2) { (void)qb; (void)k; (void)n2; return (vf){}; }
#endif

#include "cpu_vexp.h" /* vexp_in_range: e^x of scores minus their maximum, clamped at -87 */

/* Softmax of one tile's scores (lanes < n valid) of one query head against its running max m and
 * sum l; leaves the probabilities in p (zero past n) and returns the factor that rescales what was
 * accumulated. */
static inline float tile_softmax(vf sc, int64_t n, float *m, float *l, float *p) {
    const vi valid = LANES < (vi){} + (int32_t)n;
    sc = (vf)(((vi)sc & valid) | ((vi)splat(-INFINITY) & ~valid));
    const float top = hmax(sc), mx = *m > top ? *m : top;
    vf e = vexp_in_range(vmax(sc - splat(mx), splat(-87.f)));
    e = (vf)((vi)e & valid);
    memcpy(p, &e, sizeof e);
    const float corr = expf(*m - mx);
    *l = *l * corr + hsum(e);
    *m = mx;
    return corr;
}

/* One work item is a sequence and a run of its KV heads (all of them where the batch gives every
 * thread enough items): a token's K (and V) rows of adjacent heads are adjacent in the cache, so an
 * item reads each block as one stream instead of one short row per token and head.
 * Per tile of TILE keys: the tile's rows and the next tile's are located once (a walk through the block
 * table, no division per key); the next tile's rows are fetched into L2 a head and a key at a time, its K
 * rows beside the dot products of this tile's same head and key, its V rows beside the first query head's
 * P V sums (its blocks are anywhere; a fetch that finds the core's fill buffers taken holds up the work
 * behind it, so fetches spread over the tile's work cost least: a bfloat16 cache's cold reads took 6-14%
 * less time than with the whole tile's fetches issued at once, and with the V rows' fetches moved from
 * beside the dot products to beside the sums, 1.08-1.24x less again, bfloat16 at 104 positions
 * unchanged, in `pdserve bench attention-cpu --layers 30`); for each head, each K row is loaded once for
 * the head's G query heads and its G dot products left as vectors that reduce() sums W at a time; the V
 * rows are loaded once, then each query head's accumulator takes the whole tile in registers. */
#define DEFINE_DECODE(NAME, T, LD, ST, DC)                                                               \
static void NAME(const T *q, int64_t q_stride, const T *k, const T *v, int64_t block_stride,            \
                 int64_t token_stride, int64_t head_stride, const int64_t *blocks, int64_t max_blocks,   \
                 const int64_t *starts, const int64_t *spans, int64_t batch, int64_t num_kv_heads,       \
                 int64_t group, int64_t block_size, float scale, const void *init_out, int init_f32,     \
                 const int64_t *is, const float *init_lse, const int64_t *ls, T *out, float *lse,        \
                 int num_threads, int64_t heads_per_item) {                                              \
    const int64_t runs = (num_kv_heads + heads_per_item - 1) / heads_per_item;                           \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                            \
    for (int64_t item = 0; item < batch * runs; item++) {                                                \
        const int64_t b = item / runs, h0 = item % runs * heads_per_item;                                \
        const int64_t h1 = h0 + heads_per_item < num_kv_heads ? h0 + heads_per_item : num_kv_heads;     \
        const int64_t G = group, Q = (h1 - h0) * G; /* this item's query heads */                        \
        vf qv[MAX_ITEM_HEADS][DC], acc[MAX_ITEM_HEADS][DC], part[MAX_GROUP][W], vrow[TILE][DC];          \
        vb qb[MAX_ITEM_HEADS][(DC + 1) / 2]; /* the queries as bfloat16 pairs (pairs: scores scaled after) */ \
        const int pairs = BF16_PAIRS && sizeof(T) == 2 && DC % 2 == 0;                                   \
        float p[MAX_GROUP][TILE] __attribute__((aligned(64))), m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];     \
        const T *qrow = q + b * q_stride + h0 * G * DC * W;                                              \
        for (int64_t j = 0; j < Q; j++) {                                                                \
            const int64_t h = h0 + j / G, g = j % G;                                                     \
            /* A partial result over other keys (a cascade's prefix) is where the online softmax starts:  \
             * its mass e^lse is e^m * l with m = lse, l = 1, and its normalised output the accumulator. */ \
            const float lse0 = init_lse ? init_lse[b * ls[0] + h * ls[1] + g * ls[2]] : -INFINITY;       \
            const int start = lse0 > -INFINITY;                                                          \
            const int64_t io = init_lse ? b * is[0] + h * is[1] + g * is[2] : 0;                         \
            for (int c = 0; pairs && c < DC / 2; c++)                                                    \
                qb[j][c] = ld_pairs((const uint16_t *)qrow + (j * DC + 2 * c) * W);                      \
            for (int c = 0; c < DC; c++) {                                                               \
                qv[j][c] = pairs ? splat(0.f) : LD(qrow + (j * DC + c) * W) * splat(scale);              \
                acc[j][c] = !start ? splat(0.f)                                                          \
                          : init_f32 ? ld_f32((const float *)init_out + io + c * W)                      \
                                     : LD((const T *)init_out + io + c * W);                             \
            }                                                                                            \
            m[j] = start ? lse0 : -INFINITY;                                                             \
            l[j] = start ? 1.f : 0.f;                                                                    \
        }                                                                                                \
        const int64_t *row = blocks + b * max_blocks;                                                    \
        for (int64_t p0 = starts[b]; p0 < spans[b]; p0 += TILE) {                                        \
            const int64_t n = spans[b] - p0 < TILE ? spans[b] - p0 : TILE;                               \
            int64_t at[TILE], bi = p0 / block_size, off = p0 % block_size;                               \
            for (int64_t t = 0; t < n; t++) {                                                            \
                at[t] = row[bi] * block_stride + off * token_stride + h0 * head_stride;                  \
                if (++off == block_size) { off = 0; bi++; }                                              \
            }                                                                                            \
            int64_t nat[TILE], nn = 0; /* the next tile's rows */                                        \
            for (int64_t pn = p0 + n; nn < TILE && pn < spans[b]; nn++, pn++) {                          \
                nat[nn] = row[bi] * block_stride + off * token_stride + h0 * head_stride;                \
                if (++off == block_size) { off = 0; bi++; }                                              \
            }                                                                                            \
            for (int64_t h = h0; h < h1; h++) {                                                          \
                const int64_t hb = (h - h0) * head_stride, j0 = (h - h0) * G;                            \
                for (int64_t t = 0; t < n; t++) {                                                        \
                    if (t < nn) /* the next tile's K rows; its V rows go out beside the P V sums below */  \
                        for (int64_t x = 0; x < DC * W * (int64_t)sizeof(T); x += 64)                    \
                            __builtin_prefetch((const char *)(k + nat[t] + hb) + x, 0, 2);               \
                    if (pairs) {                                                                         \
                        for (int64_t g = 0; g < G; g++)                                                  \
                            part[g][BITREV[t]] = dot_pairs(qb[j0 + g], (const uint16_t *)(k + at[t] + hb), DC / 2); \
                    } else {                                                                             \
                        vf kc[DC];                                                                       \
                        for (int c = 0; c < DC; c++) kc[c] = LD(k + at[t] + hb + c * W);                 \
                        for (int64_t g = 0; g < G; g++) {                                                \
                            vf a = qv[j0 + g][0] * kc[0];                                                \
                            for (int c = 1; c < DC; c++) a += qv[j0 + g][c] * kc[c];                     \
                            part[g][BITREV[t]] = a;                                                      \
                        }                                                                                \
                    }                                                                                    \
                    for (int c = 0; c < DC; c++) vrow[t][c] = LD(v + at[t] + hb + c * W);                \
                }                                                                                        \
                if (n & 1)                                                                               \
                    for (int c = 0; c < DC; c++) vrow[n][c] = splat(0.f);                                \
                for (int64_t t = n; t < TILE; t++)                                                       \
                    for (int64_t g = 0; g < G; g++) part[g][BITREV[t]] = splat(0.f);                     \
                for (int64_t g = 0; g < G; g++) {                                                        \
                    const int64_t j = j0 + g;                                                            \
                    const vf sc = pairs ? reduce(part[g]) * splat(scale) : reduce(part[g]);              \
                    const float corr = tile_softmax(sc, n, &m[j], &l[j], p[g]);                          \
                    vf a[DC], a2[DC]; /* two chains of sums (even and odd keys): half the FMA latency */ \
                    for (int c = 0; c < DC; c++) { a[c] = acc[j][c] * splat(corr); a2[c] = splat(0.f); } \
                    for (int64_t t = 0; t < n; t += 2) { /* an odd n: p[g][n] and vrow[n] are zero */    \
                        for (int64_t u = t; g == 0 && u < t + 2 && u < nn; u++)                          \
                            for (int64_t x = 0; x < DC * W * (int64_t)sizeof(T); x += 64)                \
                                __builtin_prefetch((const char *)(v + nat[u] + hb) + x, 0, 2);           \
                        const vf w = splat(p[g][t]), w2 = splat(p[g][t + 1]);                            \
                        for (int c = 0; c < DC; c++) {                                                   \
                            a[c] += w * vrow[t][c];                                                      \
                            a2[c] += w2 * vrow[t + 1][c];                                                \
                        }                                                                                \
                    }                                                                                    \
                    for (int c = 0; c < DC; c++) acc[j][c] = a[c] + a2[c];                               \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t j = 0; j < Q; j++) {                                                                \
            const int64_t r = (b * num_kv_heads + h0) * G + j;                                           \
            const vf inv = splat(l[j] > 0.f ? 1.f / l[j] : 0.f);                                         \
            for (int c = 0; c < DC; c++) ST(out + r * DC * W + c * W, acc[j][c] * inv);                  \
            lse[r] = l[j] > 0.f ? m[j] + logf(l[j]) : -INFINITY;                                         \
        }                                                                                                \
    }                                                                                                    \
}

/* KV heads per work item: as many as MAX_ITEM_HEADS query heads allow, fewer (down to one) until
 * every thread has at least four items. */
static int64_t heads_per_item(int64_t batch, int64_t num_kv_heads, int64_t group, int num_threads) {
    int64_t n = MAX_ITEM_HEADS / group < num_kv_heads ? MAX_ITEM_HEADS / group : num_kv_heads;
    while (n > 1 && batch * ((num_kv_heads + n - 1) / n) < 4 * (int64_t)num_threads) n = (n + 1) / 2;
    return n;
}

/* One instantiation per head size (DC vectors of W floats), so that a K/V row and a head's accumulator
 * stay in registers. */
#if W == 16
#define HEAD_SIZES(X, SUFFIX, T, LD) X(SUFFIX, T, LD, 1) X(SUFFIX, T, LD, 2) X(SUFFIX, T, LD, 4) X(SUFFIX, T, LD, 5) \
    X(SUFFIX, T, LD, 6) X(SUFFIX, T, LD, 8) X(SUFFIX, T, LD, 16)
#else
#define HEAD_SIZES(X, SUFFIX, T, LD) X(SUFFIX, T, LD, 2) X(SUFFIX, T, LD, 4) X(SUFFIX, T, LD, 8) X(SUFFIX, T, LD, 10) \
    X(SUFFIX, T, LD, 12) X(SUFFIX, T, LD, 16) X(SUFFIX, T, LD, 32)
#endif
#define INSTANCE(SUFFIX, T, LD, DC) DEFINE_DECODE(decode_##SUFFIX##_##DC, T, LD, st_##SUFFIX, DC)
#define CASE(SUFFIX, T, LD, DC)                                                                           \
    case DC:                                                                                              \
        decode_##SUFFIX##_##DC(q, q_stride, k, v, block_stride, token_stride, head_stride, blocks, max_blocks,  \
                               starts, spans, batch, num_kv_heads, group, block_size, scale, init_out, init_f32,  \
                               is, init_lse, ls, out, lse, num_threads,                                           \
                               heads_per_item(batch, num_kv_heads, group, num_threads));                          \
        return 0;
#define SIZE(SUFFIX, T, LD, DC) case DC:

/* Whether head_dim has an instantiation. */
int pdserve_supports_head_dim(int64_t head_dim) {
    if (head_dim % W) return 0;
    switch (head_dim / W) {
        HEAD_SIZES(SIZE, f32, float, ld_f32) return 1;
        default: return 0;
    }
}

#define DEFINE_ENTRY(SUFFIX, T, LD)                                                                       \
    HEAD_SIZES(INSTANCE, SUFFIX, T, LD)                                                                   \
    int pdserve_paged_decode_##SUFFIX(const T *q, int64_t q_stride, const T *k, const T *v,               \
                                      int64_t block_stride, int64_t token_stride, int64_t head_stride,    \
                                      const int64_t *blocks, int64_t max_blocks, const int64_t *starts,   \
                                      const int64_t *spans, int64_t batch, int64_t num_kv_heads,          \
                                      int64_t group, int64_t head_dim, int64_t block_size, float scale,   \
                                      const void *init_out, int init_f32, const int64_t *is,              \
                                      const float *init_lse, const int64_t *ls, T *out, float *lse,       \
                                      int num_threads) {                                                  \
        if (head_dim % W || group < 1 || group > MAX_GROUP) return -1;                                    \
        switch (head_dim / W) {                                                                           \
            HEAD_SIZES(CASE, SUFFIX, T, LD)                                                               \
            default: return -1;                                                                           \
        }                                                                                                 \
    }

DEFINE_ENTRY(f32, float, ld_f32)
DEFINE_ENTRY(bf16, uint16_t, ld_bf16)
