/* A decoder layer's elementwise work on the CPU in one pass each: RMSNorm (with the residual add
 * before it), SwiGLU's silu(gate) * up, and rotary embedding in place; the argmax of each row of a
 * step's logits (greedy sampling); and the KV write, a copy of each token's rows into its cache slot
 * (pdserve_write_kv, at the end).
 *
 * At a decode step's few rows each of these is a handful of torch operators over a few kilobytes, and
 * their cost is the operators' dispatch, not the arithmetic; one call replaces them. Each reproduces
 * the rounding of the torch expression it replaces (engine/model/llama.py, engine/model/rope.py):
 * every intermediate that torch rounds to the tensor's type is rounded here too (bfloat16: round to
 * nearest even, NaN kept), and the rotation's float32 products are not contracted into FMAs (torch
 * computes them apart). What can differ is a sum's order (RMSNorm's mean of squares) and the last bits
 * of silu's exponential (vexp, against torch's own).
 *
 * Contract (checked by engine/kernels/cpu_ops.py): rows of `cols` contiguous elements at a row stride;
 * T is float (f32) or uint16_t holding bfloat16 (bf16). OpenMP splits rows when there are enough of
 * them to pay for a parallel region. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN 16384 /* elements below which one thread does it all */
#ifdef __AVX512F__
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));

static inline vf splat(float x) { return (vf){} + x; }

/* Vectors of n <= W elements (the rest zero) of each type, to and from float32; vround_T rounds to
 * T and back. bfloat16 rounds to nearest even, a NaN stays a (quiet) NaN. */
/* A whole vector is one fixed-size copy (a vector load or store); only a row's tail copies n. */
static inline vf vld_f32(const float *p, int64_t n) {
    vf v = {};
    if (n == W) memcpy(&v, p, sizeof v); else memcpy(&v, p, n * sizeof *p);
    return v;
}
static inline void vst_f32(float *p, vf v, int64_t n) {
    if (n == W) memcpy(p, &v, sizeof v); else memcpy(p, &v, n * sizeof *p);
}
static inline vf vround_f32(vf v) { return v; }
#include "cpu_bf16.h" /* widen, vbf16, vround_bf16 */

static inline vf vld_bf16(const uint16_t *p, int64_t n) {
    vh h = {};
    if (n == W) memcpy(&h, p, sizeof h); else memcpy(&h, p, n * sizeof *p);
    return widen(h);
}
static inline void vst_bf16(uint16_t *p, vf v, int64_t n) {
    const vh h = vbf16(v);
    if (n == W) memcpy(p, &h, sizeof h); else memcpy(p, &h, n * sizeof *p);
}

#include "cpu_vexp.h"

/* s = h + delta (s = h when delta is NULL), then out = weight * norm(s), the norm in float32 rounded to
 * T: `h + delta`, then `weight * F.rms_norm(s.float(), eps).to(T)`. s and out are contiguous. */
#define DEFINE_RMS_NORM(SUFFIX, T, VLD, VST, VRND)                                                       \
void pdserve_add_rms_norm_##SUFFIX(const T *h, int64_t h_stride, const T *delta, int64_t delta_stride,  \
                                   T *sum, const T *weight, T *out, int64_t rows, int64_t cols,          \
                                   float eps, int num_threads) {                                        \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * cols >= PARALLEL_MIN)") \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const T *x = h + r * h_stride;                                                                   \
        if (delta) {                                                                                     \
            const T *d = delta + r * delta_stride;                                                       \
            T *s = sum + r * cols;                                                                       \
            for (int64_t i = 0; i < cols; i += W) {                                                      \
                const int64_t n = cols - i < W ? cols - i : W;                                           \
                VST(s + i, VLD(x + i, n) + VLD(d + i, n), n);                                            \
            }                                                                                            \
            x = s;                                                                                       \
        }                                                                                                \
        vf acc = {};                                                                                     \
        for (int64_t i = 0; i < cols; i += W) {                                                          \
            const vf a = VLD(x + i, cols - i < W ? cols - i : W);                                        \
            acc += a * a;                                                                                \
        }                                                                                                \
        float ss = 0.f;                                                                                  \
        for (int i = 0; i < W; i++) ss += acc[i];                                                        \
        const float inv = 1.f / sqrtf(ss / (float)cols + eps);                                           \
        T *o = out + r * cols;                                                                           \
        for (int64_t i = 0; i < cols; i += W) {                                                          \
            const int64_t n = cols - i < W ? cols - i : W;                                               \
            VST(o + i, VLD(weight + i, n) * VRND(VLD(x + i, n) * splat(inv)), n);                        \
        }                                                                                                \
    }                                                                                                    \
}

/* out = silu(gate) * up for gate = gu[:, :inter], up = gu[:, inter:]: `F.silu(gate) * up`, silu
 * rounded to T before the product. */
#define DEFINE_SILU_MUL(SUFFIX, T, VLD, VST, VRND)                                                          \
void pdserve_silu_mul_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows, \
                               int64_t inter, int num_threads) {                                        \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * inter >= PARALLEL_MIN)") \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const T *g = gu + r * gu_stride, *u = g + inter;                                                 \
        T *o = out + r * out_stride;                                                                     \
        for (int64_t i = 0; i < inter; i += W) {                                                         \
            const int64_t n = inter - i < W ? inter - i : W;                                             \
            const vf x = VLD(g + i, n);                                                                  \
            VST(o + i, VRND(vsilu(x)) * VLD(u + i, n), n);                                                  \
        }                                                                                                \
    }                                                                                                    \
}

/* Rotary embedding in place on `heads` heads of each row (head h at x + row * stride + h * head_dim):
 * with x1, x2 the halves, `cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`, every product and sum
 * rounded to T; cos and sin are [rows, head_dim / 2] of T. */
#define DEFINE_ROTARY(SUFFIX, T, VLD, VST, VRND)                                                            \
void pdserve_rotary_##SUFFIX(T *x, int64_t stride, int64_t rows, int64_t heads, int64_t head_dim,       \
                             const T *cos, const T *sin, int num_threads) {                             \
    const int64_t half = head_dim / 2;                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * heads * head_dim >= PARALLEL_MIN)") \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const T *c = cos + r * half, *s = sin + r * half;                                                \
        for (int64_t h = 0; h < heads; h++) {                                                            \
            T *x1 = x + r * stride + h * head_dim, *x2 = x1 + half;                                      \
            for (int64_t i = 0; i < half; i += W) {                                                      \
                const int64_t n = half - i < W ? half - i : W;                                           \
                const vf a = VLD(x1 + i, n), b = VLD(x2 + i, n), ci = VLD(c + i, n), si = VLD(s + i, n); \
                VST(x1 + i, VRND(a * ci) - VRND(b * si), n);                                             \
                VST(x2 + i, VRND(b * ci) + VRND(a * si), n);                                             \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
}

DEFINE_RMS_NORM(f32, float, vld_f32, vst_f32, vround_f32)
DEFINE_RMS_NORM(bf16, uint16_t, vld_bf16, vst_bf16, vround_bf16)
DEFINE_SILU_MUL(f32, float, vld_f32, vst_f32, vround_f32)
DEFINE_SILU_MUL(bf16, uint16_t, vld_bf16, vst_bf16, vround_bf16)
/* Products and sums apart, as torch computes them (no FMA contraction): the rotation is exact. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
DEFINE_ROTARY(f32, float, vld_f32, vst_f32, vround_f32)
DEFINE_ROTARY(bf16, uint16_t, vld_bf16, vst_bf16, vround_bf16)
#pragma GCC pop_options

/* out[r] = the index of row r's largest value, the first of tied maxima, and the first NaN where the row
 * has one: torch's `x.max(dim=-1).indices` (of x widened to float32, which keeps the order). One pass:
 * each lane keeps its largest value and the first vector that held it (a strict > only moves it on), so
 * of the lanes holding the row's maximum the lowest index is the first; NaN, rare, is found by a scan. */
#define DEFINE_ARGMAX(SUFFIX, T, VLD)                                                                     \
void pdserve_argmax_rows_##SUFFIX(const T *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out, \
                                  int num_threads) {                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * cols >= PARALLEL_MIN)") \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const T *row = x + r * stride;                                                                   \
        const int64_t body = cols / W * W;                                                               \
        int64_t best = 0;                                                                                \
        float top = -INFINITY;                                                                           \
        vi nan = {};                                                                                     \
        if (body) {                                                                                      \
            vf hi = VLD(row, W);                                                                         \
            vi at = {}, here = {};                                                                       \
            nan |= (vi)(hi != hi);                                                                       \
            for (int64_t i = W; i < body; i += W) {                                                      \
                const vf v = VLD(row + i, W);                                                            \
                const vi up = (vi)(v > hi);                                                              \
                here += W;                                                                               \
                hi = (vf)(((vi)v & up) | ((vi)hi & ~up));                                                \
                at = (here & up) | (at & ~up);                                                           \
                nan |= (vi)(v != v);                                                                     \
            }                                                                                            \
            best = cols;                                                                                 \
            for (int j = 0; j < W; j++) top = hi[j] > top ? hi[j] : top;                                 \
            for (int j = 0; j < W; j++)                                                                  \
                if (hi[j] == top && at[j] + j < best) best = at[j] + j;                                  \
        }                                                                                                \
        for (int64_t i = body; i < cols; i++) {                                                          \
            const float v = VLD(row + i, 1)[0];                                                          \
            if (v > top || (i == 0 && !(v != v))) { top = v; best = i; }                                 \
            if (v != v) nan[0] = 1;                                                                      \
        }                                                                                                \
        int any_nan = 0;                                                                                 \
        for (int j = 0; j < W; j++) any_nan |= nan[j] != 0;                                              \
        if (any_nan)                                                                                     \
            for (int64_t i = 0; i < cols; i++) {                                                         \
                const float v = VLD(row + i, 1)[0];                                                      \
                if (v != v) { best = i; break; }                                                         \
            }                                                                                            \
        out[r] = best;                                                                                   \
    }                                                                                                    \
}

DEFINE_ARGMAX(f32, float, vld_f32)
DEFINE_ARGMAX(bf16, uint16_t, vld_bf16)

/* Each token's K and V rows (row_bytes: its heads, adjacent) copied into slot slots[t] of the caches,
 * block slots[t] / block_size at offset slots[t] % block_size (strides in bytes); a negative slot
 * skips the token. A decode step writes a few hundred bytes per token: a loop, not a parallel one. */
void pdserve_write_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_cache,
                      char *v_cache, int64_t block_stride, int64_t token_stride, const int64_t *slots, int64_t tokens,
                      int64_t block_size, int64_t row_bytes) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int64_t at = (s / block_size) * block_stride + (s % block_size) * token_stride;
        memcpy(k_cache + at, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + at, value + t * value_stride, (size_t)row_bytes);
    }
}
