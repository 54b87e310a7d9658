/* A cascade's shared-prefix attention in float32 on the CPU.
 *
 * Every decode sequence of a step reads the same prefix keys, so for each KV head the query rows of all
 * sequences (batch x GQA group) meet one set of keys: per tile of 16 keys, S = Q K^T is a small matrix
 * product. The call first lays each head's K out transposed by tiles (kt: per tile, d rows of its 16 keys),
 * so that a query row's 16 scores are one vector, summed over the dims with the query's value broadcast
 * (no horizontal sums); then each work item (a KV head and ROWS query rows) runs an online softmax over the
 * tiles in float32 and accumulates P V from V's rows where the caller's gather left them, the ROWS rows'
 * sums in registers. Both phases run in one parallel region (the pack's barrier between them).
 *
 * Contract (checked by engine/kernels/cpu_prefix.py): query head g of KV head h of sequence b at
 * q + b * q_stride + (h * group + g) * d (d contiguous floats); k, v [keys][heads][d] float32, contiguous
 * (one layer of the cascade's gathered prefix); kt a buffer of heads * ceil(keys / 16) * d * 16 floats;
 * d a multiple of 16 that HEAD_SIZES instantiates (pdserve_prefix_supports_head_dim: none without AVX-512);
 * keys, batch, group >= 1; scale > 0; out
 * [heads][group][batch][d] float32 and lse [heads][group][batch] float32 (natural log-sum-exp of the
 * scaled scores), contiguous. Returns 0; -1 without writing where d has no instantiation. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define W 16    /* floats per vector (GCC/Clang vector extensions, lowered to what -march=native has) */
#define TILE 16 /* keys per tile: one vector of scores per query row */
#define ROWS 6  /* query rows per item: their P V sums stay in registers (ROWS x d / 16 vectors) */
#define CHUNK_TILES 16 /* tiles whose softmax is taken at once (256 keys) */
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

#include "cpu_splat.h" /* splat: a broadcast, not an add on the FMA ports */
static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vmax(vf a, vf b) { vi m = a > b; return (vf)(((vi)a & m) | ((vi)b & ~m)); }
#include "cpu_lanes.h" /* LANES, hsum, hmax; LOn / HIn for the transpose */
#include "cpu_vexp.h"  /* vexp_in_range */

/* The 16 x 16 floats m[16] transposed in place: four levels of swapping off-diagonal blocks (8, 4, 2, 1
 * lanes), each two shuffles per pair of rows. */
#define SWAP(m, b, LO, HI)                                                                               \
    for (int r = 0; r < W; r++)                                                                          \
        if (!(r & b)) {                                                                                  \
            const vf x = m[r], y = m[r + b];                                                             \
            m[r] = __builtin_shufflevector(x, y, LO);                                                    \
            m[r + b] = __builtin_shufflevector(x, y, HI);                                                \
        }
static inline void transpose(vf *m) {
    SWAP(m, 8, LO8, HI8) SWAP(m, 4, LO4, HI4) SWAP(m, 2, LO2, HI2) SWAP(m, 1, LO1, HI1)
}

/* K's tile t of head h transposed: kt[c][j] = key t * TILE + j's value at dim c (zero past the keys),
 * 16 dims at a time. */
static void pack_tile(const float *k, int64_t heads, int64_t d, int64_t keys, int64_t h, int64_t t, float *kt) {
    const int64_t n = keys - t * TILE < TILE ? keys - t * TILE : TILE;
    for (int64_t c0 = 0; c0 < d; c0 += W) {
        vf m[W];
        for (int64_t j = 0; j < W; j++) m[j] = j < n ? ld(k + ((t * TILE + j) * heads + h) * d + c0) : splat(0.f);
        transpose(m);
        for (int i = 0; i < W; i++) st(kt + (c0 + i) * TILE, m[i]);
    }
}

/* Softmax of one chunk's scores (tiles vectors sc[0, tiles), keys < n valid) of one row against its running
 * max m and sum l: the probabilities to p (zero past n, up to the last tile's end), and the factor that
 * rescales what was accumulated. The chunk's maximum and sum go over all its tiles at once, so the chain
 * of reductions and exponentials runs once a chunk. */
static inline float chunk_softmax(const vf *sc, int tiles, int64_t n, float *m, float *l, float *p) {
    vf top = splat(-INFINITY);
    for (int t = 0; t < tiles; t++) top = vmax(top, sc[t]); /* lanes past n: the caller set them to -inf */
    const float most = hmax(top), mx = *m > most ? *m : most;
    vf sum = splat(0.f);
    for (int t = 0; t < tiles; t++) {
        const vi valid = LANES + t * TILE < (vi){} + (int32_t)n;
        const vf e = (vf)((vi)vexp_in_range(vmax(sc[t] - splat(mx), splat(-87.f))) & valid);
        memcpy(p + t * TILE, &e, sizeof e);
        sum += e;
    }
    const float corr = expf(*m - mx);
    *l = *l * corr + hsum(sum);
    *m = mx;
    return corr;
}

/* One item: KV head h, query rows [r0, r0 + count) of the head's group * batch (row r: query head
 * r / batch of sequence r % batch), count <= ROWS. Rows past count repeat row r0 (their results unused).
 * Keys go in chunks of CHUNK_TILES tiles: first every tile's scores (two tiles a pass over the dims, twice
 * the independent sums), then each row's softmax over the chunk, then P V over its keys. */
#define DEFINE_ITEM(DC)                                                                                  \
static void item_##DC(const float *q, int64_t q_stride, const float *v, const float *kt, int64_t heads,   \
                      int64_t group, int64_t batch, int64_t keys, float scale, int64_t h, int64_t r0,     \
                      int64_t count, float *out, float *lse) {                                           \
    const int64_t d = DC * W, tiles = (keys + TILE - 1) / TILE;                                          \
    const float *qr[ROWS];                                                                               \
    for (int i = 0; i < ROWS; i++) {                                                                     \
        const int64_t r = r0 + (i < count ? i : 0);                                                      \
        qr[i] = q + (r % batch) * q_stride + (h * group + r / batch) * d;                                \
    }                                                                                                    \
    vf acc[ROWS][DC], sc[ROWS][CHUNK_TILES + 1];                                                         \
    float m[ROWS], l[ROWS], p[ROWS][CHUNK_TILES * TILE] __attribute__((aligned(64)));                    \
    for (int i = 0; i < ROWS; i++) {                                                                     \
        m[i] = -INFINITY;                                                                                \
        l[i] = 0.f;                                                                                      \
        for (int c = 0; c < DC; c++) acc[i][c] = splat(0.f);                                             \
    }                                                                                                    \
    for (int64_t t0 = 0; t0 < tiles; t0 += CHUNK_TILES) {                                                \
        const int ct = (int)(tiles - t0 < CHUNK_TILES ? tiles - t0 : CHUNK_TILES);                       \
        const int64_t n = keys - t0 * TILE < ct * TILE ? keys - t0 * TILE : ct * TILE;                    \
        for (int t = 0; t < ct; t += 2) { /* an odd ct: the pair's second tile is the first again */     \
            const float *ka = kt + (h * tiles + t0 + t) * d * TILE;                                      \
            const float *kb = t + 1 < ct ? ka + d * TILE : ka;                                           \
            vf sa[ROWS], sb[ROWS];                                                                       \
            for (int i = 0; i < ROWS; i++) sa[i] = sb[i] = splat(0.f);                                   \
            for (int64_t c = 0; c < d; c++) {                                                            \
                const vf va = ld(ka + c * TILE), vb = ld(kb + c * TILE);                                 \
                for (int i = 0; i < ROWS; i++) {                                                         \
                    const vf x = splat(qr[i][c]);                                                        \
                    sa[i] += x * va;                                                                     \
                    sb[i] += x * vb;                                                                     \
                }                                                                                        \
            }                                                                                            \
            for (int i = 0; i < ROWS; i++) { sc[i][t] = sa[i] * splat(scale); sc[i][t + 1] = sb[i] * splat(scale); } \
        }                                                                                                \
        if (n % TILE) { /* the last tile's lanes past the keys out of the maximum */                     \
            const vi valid = LANES < (vi){} + (int32_t)(n % TILE);                                       \
            for (int i = 0; i < ROWS; i++)                                                               \
                sc[i][ct - 1] = (vf)(((vi)sc[i][ct - 1] & valid) | ((vi)splat(-INFINITY) & ~valid));     \
        }                                                                                                \
        for (int i = 0; i < ROWS; i++) {                                                                 \
            const vf corr = splat(chunk_softmax(sc[i], ct, n, &m[i], &l[i], p[i]));                      \
            for (int c = 0; c < DC; c++) acc[i][c] *= corr;                                              \
        }                                                                                                \
        for (int64_t j = 0; j < n; j++) {                                                                \
            const float *vr = v + ((t0 * TILE + j) * heads + h) * d;                                     \
            for (int c = 0; c < DC; c++) {                                                               \
                const vf vc = ld(vr + c * W);                                                            \
                for (int i = 0; i < ROWS; i++) acc[i][c] += splat(p[i][j]) * vc;                         \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int64_t i = 0; i < count; i++) {                                                                \
        const int64_t r = (h * group * batch) + r0 + i; /* out [heads][group][batch]: row r of head h */ \
        const vf inv = splat(1.f / l[i]);                                                                \
        for (int c = 0; c < DC; c++) st(out + r * d + c * W, acc[i][c] * inv);                           \
        lse[r] = m[i] + logf(l[i]);                                                                      \
    }                                                                                                    \
}

/* One instantiation per head size (DC vectors of 16 floats), as cpu_decode.c's. */
#define HEAD_SIZES(X) X(1) X(2) X(4) X(5) X(6) X(8) X(16)
HEAD_SIZES(DEFINE_ITEM)
typedef void (*item_fn)(const float *, int64_t, const float *, const float *, int64_t, int64_t, int64_t, int64_t,
                        float, int64_t, int64_t, int64_t, float *, float *);
#define ITEM_CASE(DC) case DC: return item_##DC;
static item_fn item_for(int64_t d) {
    if (d % W) return 0;
    switch (d / W) {
        HEAD_SIZES(ITEM_CASE)
        default: return 0;
    }
}

/* Whether this build runs head size d: an instantiation, and AVX-512, whose registers the 16-lane vectors fill
 * (built for AVX2 they ran 30x slower than ATen's flash operator, which then runs instead). */
int pdserve_prefix_supports_head_dim(int64_t d) {
#ifdef __AVX512F__
    return item_for(d) != 0;
#else
    (void)d;
    (void)item_for;
    return 0;
#endif
}

int pdserve_prefix_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v, float *kt,
                                 int64_t batch, int64_t heads, int64_t group, int64_t keys, int64_t d, float scale,
                                 float *out, float *lse, int num_threads) {
    if (!pdserve_prefix_supports_head_dim(d) || batch < 1 || heads < 1 || group < 1 || keys < 1) return -1;
    const item_fn item = item_for(d);
    const int64_t tiles = (keys + TILE - 1) / TILE, rows = group * batch, blocks = (rows + ROWS - 1) / ROWS;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t ht = 0; ht < heads * tiles; ht++)
            pack_tile(k, heads, d, keys, ht / tiles, ht % tiles, kt + ht * d * TILE);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < heads * blocks; it++) {
            const int64_t h = it / blocks, r0 = it % blocks * ROWS;
            item(q, q_stride, v, kt, heads, group, batch, keys, scale, h, r0, rows - r0 < ROWS ? rows - r0 : ROWS, out,
                 lse);
        }
    }
    return 0;
}
