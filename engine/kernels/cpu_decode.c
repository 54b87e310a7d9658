/* Paged decode attention on the CPU, reading K/V in place from the cache blocks.
 *
 * Contract (checked by engine/kernels/cpu_decode.py before every call):
 *   q      [batch, num_kv_heads * group, head_dim], contiguous, of the cache's element type;
 *   k, v   caches addressed as base + block * block_stride + offset * token_stride + head * head_stride,
 *          each head's head_dim elements contiguous;
 *   blocks [batch, max_blocks] int64: sequence b's position p lives in block blocks[b][p / block_size];
 *   positions starts[b] <= p < spans[b] are attended (a window or a cascade's suffix starts past 0);
 *   out    [batch, num_kv_heads * group, head_dim] float32, lse [batch, num_kv_heads * group] float32
 *          (natural log-sum-exp of the scaled scores; -inf and a zero row where no position is read).
 * group <= MAX_GROUP, and head_dim one of the sizes HEAD_SIZES instantiates (pdserve_supports_head_dim);
 * the entry points return -1 without reading anything otherwise, 0 when done.
 *
 * One (sequence, KV head) pair per OpenMP iteration; the pair's query heads (its GQA group) share each
 * K/V row it loads. Keys go in tiles of TILE with an online softmax, accumulated in float32. Vectors
 * are GCC/Clang vector extensions (W floats), lowered to whatever SIMD the CPU has (-march=native).
 * The OpenMP runtime is the one torch already loaded (same soname), so these threads are torch's
 * intra-op threads. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define W 8
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));

int pdserve_max_group(void) { return MAX_GROUP; }
int pdserve_max_head_dim(void) { return MAX_HEAD_DIM; }

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vf ld_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf ld_bf16(const uint16_t *p) {
    vh h; memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v; memcpy(&v, &u, sizeof v); return v;
}
/* The sum of a vector's lanes, by halving. */
static inline float hsum(vf v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}
/* e^x for -87 <= x <= 0 (scores minus their maximum): x = n ln2 + r with |r| <= ln2/2, e^r by its
 * degree-6 Taylor polynomial (relative error under 3e-7), 2^n through the exponent bits. */
static inline vf vexp(vf x) {
    const vf shifter = splat(12582912.f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    vf n = (x * splat(1.44269504088896341f) + shifter) - shifter;
    vf r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
    vf p = splat(1.f / 720.f);
    p = p * r + splat(1.f / 120.f);
    p = p * r + splat(1.f / 24.f);
    p = p * r + splat(1.f / 6.f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.f);
    p = p * r + splat(1.f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf s; memcpy(&s, &e, sizeof s);
    return p * s;
}

/* Softmax of one tile's scores s[0..n) of one query head against its running max m and sum l;
 * leaves the probabilities in s and returns the factor that rescales what was accumulated. */
static inline float tile_softmax(float *s, int64_t n, float *m, float *l) {
    float mx = *m;
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    for (int64_t t = 0; t < TILE; t++) {
        const float x = t < n ? s[t] - mx : -87.f;
        s[t] = x < -87.f ? -87.f : x;
    }
    vf sum = splat(0.f);
    for (int64_t t = 0; t < TILE; t += W) {
        vf e = vexp(ld_f32(s + t));
        for (int i = 0; i < W; i++) e[i] = t + i < n ? e[i] : 0.f;
        memcpy(s + t, &e, sizeof e);
        sum += e;
    }
    const float corr = expf(*m - mx);
    *l = *l * corr + hsum(sum);
    *m = mx;
    return corr;
}

#define DEFINE_DECODE(NAME, T, LD, DC)                                                                   \
static void NAME(const T *q, const T *k, const T *v, int64_t block_stride, int64_t token_stride,        \
                 int64_t head_stride, const int64_t *blocks, int64_t max_blocks, const int64_t *starts,  \
                 const int64_t *spans, int64_t batch, int64_t num_kv_heads, int64_t group,               \
                 int64_t block_size, float scale, float *out, float *lse, int num_threads) {             \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")               \
    for (int64_t b = 0; b < batch; b++) {                                                                \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                     \
            const int64_t G = group;                                                                     \
            vf qv[MAX_GROUP][DC], acc[MAX_GROUP][DC];                                                    \
            float s[MAX_GROUP][TILE] __attribute__((aligned(32))), m[MAX_GROUP], l[MAX_GROUP];           \
            const T *qrow = q + (b * num_kv_heads + h) * G * DC * W;                                     \
            for (int64_t g = 0; g < G; g++) {                                                            \
                for (int c = 0; c < DC; c++) {                                                           \
                    qv[g][c] = LD(qrow + (g * DC + c) * W) * splat(scale);                               \
                    acc[g][c] = splat(0.f);                                                              \
                }                                                                                        \
                m[g] = -INFINITY;                                                                        \
                l[g] = 0.f;                                                                              \
            }                                                                                            \
            const int64_t *row = blocks + b * max_blocks;                                                \
            const int64_t base = h * head_stride;                                                        \
            for (int64_t p0 = starts[b]; p0 < spans[b]; p0 += TILE) {                                    \
                const int64_t n = spans[b] - p0 < TILE ? spans[b] - p0 : TILE;                           \
                for (int64_t t = 0; t < n; t++) {                                                        \
                    const int64_t p = p0 + t;                                                            \
                    const T *kr = k + row[p / block_size] * block_stride + (p % block_size) * token_stride \
                                  + base;                                                                \
                    vf kc[DC];                                                                           \
                    for (int c = 0; c < DC; c++) kc[c] = LD(kr + c * W);                                 \
                    for (int64_t g = 0; g < G; g++) {                                                    \
                        vf a = qv[g][0] * kc[0];                                                         \
                        for (int c = 1; c < DC; c++) a += qv[g][c] * kc[c];                              \
                        s[g][t] = hsum(a);                                                               \
                    }                                                                                    \
                }                                                                                        \
                for (int64_t g = 0; g < G; g++) {                                                        \
                    const float corr = tile_softmax(s[g], n, &m[g], &l[g]);                              \
                    vf a[DC];                                                                            \
                    for (int c = 0; c < DC; c++) a[c] = acc[g][c] * splat(corr);                         \
                    for (int64_t t = 0; t < n; t++) {                                                    \
                        const int64_t p = p0 + t;                                                        \
                        const T *vr = v + row[p / block_size] * block_stride                             \
                                      + (p % block_size) * token_stride + base;                          \
                        const vf w = splat(s[g][t]);                                                     \
                        for (int c = 0; c < DC; c++) a[c] += w * LD(vr + c * W);                         \
                    }                                                                                    \
                    for (int c = 0; c < DC; c++) acc[g][c] = a[c];                                       \
                }                                                                                        \
            }                                                                                            \
            for (int64_t g = 0; g < G; g++) {                                                            \
                const int64_t r = (b * num_kv_heads + h) * G + g;                                        \
                const vf inv = splat(l[g] > 0.f ? 1.f / l[g] : 0.f);                                     \
                for (int c = 0; c < DC; c++) {                                                           \
                    const vf o = acc[g][c] * inv;                                                        \
                    memcpy(out + r * DC * W + c * W, &o, sizeof o);                                      \
                }                                                                                        \
                lse[r] = l[g] > 0.f ? m[g] + logf(l[g]) : -INFINITY;                                     \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
}

/* One instantiation per head size (DC vectors of W floats), so that a K/V row and a head's accumulator
 * stay in registers. */
#define HEAD_SIZES(X, SUFFIX, T, LD) X(SUFFIX, T, LD, 2) X(SUFFIX, T, LD, 4) X(SUFFIX, T, LD, 8) X(SUFFIX, T, LD, 10) \
    X(SUFFIX, T, LD, 12) X(SUFFIX, T, LD, 16) X(SUFFIX, T, LD, 32)
#define INSTANCE(SUFFIX, T, LD, DC) DEFINE_DECODE(decode_##SUFFIX##_##DC, T, LD, DC)
#define CASE(SUFFIX, T, LD, DC)                                                                           \
    case DC:                                                                                              \
        decode_##SUFFIX##_##DC(q, k, v, block_stride, token_stride, head_stride, blocks, max_blocks, starts, \
                               spans, batch, num_kv_heads, group, block_size, scale, out, lse, num_threads); \
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
    int pdserve_paged_decode_##SUFFIX(const T *q, const T *k, const T *v, int64_t block_stride,           \
                                      int64_t token_stride, int64_t head_stride, const int64_t *blocks,   \
                                      int64_t max_blocks, const int64_t *starts, const int64_t *spans,    \
                                      int64_t batch, int64_t num_kv_heads, int64_t group,                 \
                                      int64_t head_dim, int64_t block_size, float scale, float *out,      \
                                      float *lse, int num_threads) {                                      \
        if (head_dim % W || group < 1 || group > MAX_GROUP) return -1;                                    \
        switch (head_dim / W) {                                                                           \
            HEAD_SIZES(CASE, SUFFIX, T, LD)                                                               \
            default: return -1;                                                                           \
        }                                                                                                 \
    }

DEFINE_ENTRY(f32, float, ld_f32)
DEFINE_ENTRY(bf16, uint16_t, ld_bf16)
