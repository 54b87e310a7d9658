/* A Llama decoder stack's decode step as one call: every layer's kernel calls in a row, made from C.
 *
 * engine/model/decode_replay.py runs a decode step's layers as the C kernels' calls alone. Made from
 * Python, each of a layer's ten calls converts its 10-25 arguments through ctypes, about 300 calls a step
 * (1.3-2 ms of a bfloat16 step of SmolLM2-135M over 32 sequences, while the other OpenMP thread waits).
 * Here the same calls, in the same order with the same arguments, are made from one entry point that
 * reads them from two structures (struct step, struct layer), so the results are the Python loop's bit
 * for bit. The kernels are called through the addresses the caller took from their own libraries
 * (cpu_ops.c, cpu_amx.c or cpu_gemm.c, cpu_decode.c, cpu_amx_prefix.c, cpu_prefix.c); the function types
 * below are those libraries' signatures (engine/kernels/cpu_replay.py mirrors both structures).
 *
 * Contract: what decode_replay.build checked holds (every kernel takes the step's shapes; the buffers
 * are the step's, of the sizes DecodeReplay allocates). Returns 0, or the first refusal: REFUSED_PROJECTION,
 * REFUSED_DECODE, REFUSED_PREFIX32 or NO_ROW_BUFFER (the AMX prefix kernel's), with s->failed_layer set.
 * On return s->residual says where the last layer's residual is (-1: h, else res[0] or res[1]) and
 * s->packed_layer which layer the AMX prefix buffers hold (-1: none). */
#include <stddef.h>
#include <stdint.h>

enum { REFUSED_PROJECTION = 1, REFUSED_DECODE = 2, REFUSED_PREFIX32 = 3, NO_ROW_BUFFER = 4 };
enum { PREFIX_NONE = 0, PREFIX_TILES = 1, PREFIX_F32 = 2 };

typedef int (*project_fn)(const void *x, int64_t x_stride, const void *w, const void *bias, void *out, int64_t rows,
                          int64_t n, int64_t k, int threads);
typedef void (*norm_fn)(const void *h, int64_t h_stride, const void *delta, int64_t delta_stride, void *sum,
                        const void *weight, void *out, int64_t rows, int64_t cols, float eps, int threads);
typedef void (*rotary_fn)(void *x, int64_t stride, int64_t rows, int64_t heads, int64_t head_dim, const void *cos,
                          const void *sin, int threads);
typedef void (*write_kv_fn)(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                            char *k_cache, char *v_cache, int64_t block_stride, int64_t token_stride,
                            const int64_t *slots, int64_t tokens, int64_t block_size, int64_t row_bytes);
typedef int (*decode_fn)(const void *q, int64_t q_stride, const void *k, const void *v, int64_t block_stride,
                         int64_t token_stride, int64_t head_stride, const int64_t *blocks, int64_t max_blocks,
                         const int64_t *starts, const int64_t *spans, int64_t batch, int64_t num_kv_heads,
                         int64_t group, int64_t head_dim, int64_t block_size, float scale, const void *init_out,
                         int init_f32, const int64_t *is, const float *init_lse, const int64_t *ls, void *out,
                         float *lse, int threads);
typedef int (*tiles_fn)(const void *cache, int64_t block_stride, int64_t plane_stride, int64_t token_stride,
                        int64_t head_stride, const int64_t *blocks, int64_t block_size, const void *q, int64_t q_stride,
                        void *kp, void *vp, float *out, float *lse, int64_t batch, int64_t heads, int64_t group,
                        int64_t keys, int64_t keys_pad, int64_t d, float scale, int threads);
typedef int (*prefix32_fn)(const void *q, int64_t q_stride, const void *k, const void *v, void *kt, int64_t batch,
                           int64_t heads, int64_t group, int64_t keys, int64_t d, float scale, float *out, float *lse,
                           int threads);

struct projection { void *fn; const void *packed, *bias; };

/* One layer: its norms' weights, its projections' kernels and packed weights, its K and V planes. */
struct layer {
    const void *norm1, *norm2;
    double eps1, eps2;
    struct projection qkv, o, glu, down;
    char *k, *v;
};

/* A step: the kernels, the shapes, the buffers (element counts are elements of the step's dtype unless
 * they say bytes), the decode kernel's reads, and the cascade's prefix where the step has one. */
struct step {
    void *norm, *rotary, *write_kv, *decode, *prefix_fn;
    int64_t prefix; /* PREFIX_* */
    int64_t rows, hidden, inter, heads, kv_heads, head_dim, elem_bytes, threads;
    double scale;
    void *h, *x, *o, *down, *res[2], *qkv, *act, *attn, *lse;
    const void *cos, *sin, *slots;
    int64_t block_stride, token_stride, head_stride, block_size; /* the cache's, in elements */
    const void *blocks, *starts, *spans;
    int64_t max_blocks;
    const void *init_out, *is, *init_lse, *ls; /* the decode kernel's prefix part (init_out NULL: none) */
    int64_t init_f32;
    /* PREFIX_TILES: the cache view's base and strides (elements), the prefix's blocks, the pack buffers */
    const char *tiles_view;
    int64_t tv_block, tv_layer, tv_plane, tv_token, tv_head;
    const void *tiles_blocks, *kp, *vp;
    int64_t keys, keys_pad;
    /* PREFIX_F32: each layer's gathered K and V (2 per layer), the kernel's workspace */
    const void *const *prefix_kv;
    void *kt;
    /* the prefix part's results, where the decode kernel reads them (init_out and init_lse point here) */
    void *shared_out, *shared_lse;
    /* in and out */
    int64_t packed_layer, failed_layer, residual;
};

/* A row of the step's q, k and v: every query head's values, then every KV head's K, then V. */
static inline int64_t qkv_width(const struct step *s) { return (s->heads + 2 * s->kv_heads) * s->head_dim; }

static int project(const struct projection *p, const void *x, int64_t x_stride, void *out, int64_t rows, int64_t n,
                   int64_t k, int threads) {
    return ((project_fn)p->fn)(x, x_stride, p->packed, p->bias, out, rows, n, k, threads);
}

/* Layer i's prefix part into s->shared_out / shared_lse (none without a prefix). */
static int prefix_part(struct step *s, int64_t i, const char *qkv, int threads) {
    const int64_t group = s->heads / s->kv_heads, width = qkv_width(s);
    if (s->prefix == PREFIX_TILES) {
        const char *cache = i == s->packed_layer ? NULL : s->tiles_view + i * s->tv_layer * s->elem_bytes;
        const int failed = ((tiles_fn)s->prefix_fn)(cache, s->tv_block, s->tv_plane, s->tv_token, s->tv_head,
                                                    s->tiles_blocks, s->block_size, qkv, width, (void *)s->kp,
                                                    (void *)s->vp, s->shared_out, s->shared_lse, s->rows, s->kv_heads,
                                                    group, s->keys, s->keys_pad, s->head_dim, (float)s->scale, threads);
        s->packed_layer = failed ? -1 : i; /* after a failure, the next call packs again */
        return failed ? NO_ROW_BUFFER : 0;
    }
    if (s->prefix == PREFIX_F32)
        return ((prefix32_fn)s->prefix_fn)(qkv, width, s->prefix_kv[2 * i], s->prefix_kv[2 * i + 1], s->kt, s->rows,
                                           s->kv_heads, group, s->keys, s->head_dim, (float)s->scale, s->shared_out,
                                           s->shared_lse, threads) ? REFUSED_PREFIX32 : 0;
    return 0;
}

/* Layer i's q and k rotated in s->qkv, its K and V written to the cache, its attention into s->attn. */
static int attend(struct step *s, const struct layer *l, int64_t i, int threads) {
    const int64_t n = s->rows, es = s->elem_bytes, q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t width = qkv_width(s), row_bytes = width * es;
    char *qkv = s->qkv;
    ((rotary_fn)s->rotary)(qkv, width, n, s->heads + s->kv_heads, s->head_dim, s->cos, s->sin, threads);
    ((write_kv_fn)s->write_kv)(qkv + q_size * es, row_bytes, qkv + (q_size + kv_size) * es, row_bytes, l->k, l->v,
                               s->block_stride * es, s->token_stride * es, s->slots, n, s->block_size, kv_size * es);
    const int failed = prefix_part(s, i, qkv, threads);
    if (failed) return failed;
    return ((decode_fn)s->decode)(qkv, width, l->k, l->v, s->block_stride, s->token_stride, s->head_stride, s->blocks,
                                  s->max_blocks, s->starts, s->spans, n, s->kv_heads, s->heads / s->kv_heads,
                                  s->head_dim, s->block_size, (float)s->scale, s->init_out, (int)s->init_f32, s->is,
                                  s->init_lse, s->ls, s->attn, s->lse, threads) ? REFUSED_DECODE : 0;
}

int pdserve_replay_stack(struct step *s, const struct layer *layers, int64_t num_layers) {
    const int64_t n = s->rows, width = s->hidden, inter = s->inter, q_size = s->heads * s->head_dim;
    const int threads = (int)s->threads;
    const norm_fn norm = (norm_fn)s->norm;
    /* Each norm after a residual add writes the new residual into the buffer its input is not in. */
    int64_t residual = -1, turn = 0;
#define BUF(r) ((r) < 0 ? s->h : s->res[r])
    s->failed_layer = -1;
    for (int64_t i = 0; i < num_layers; i++) {
        const struct layer *l = &layers[i];
        if (i == 0) { /* the first layer: its norm's input is the residual itself, no add */
            norm(s->h, width, NULL, 0, s->h, l->norm1, s->x, n, width, (float)l->eps1, threads);
        } else {
            const int64_t last = residual;
            residual = turn, turn ^= 1;
            norm(BUF(last), width, s->down, width, BUF(residual), l->norm1, s->x, n, width, (float)l->eps1, threads);
        }
        int failed = project(&l->qkv, s->x, width, s->qkv, n, qkv_width(s), width, threads) ? REFUSED_PROJECTION
                                                                                            : attend(s, l, i, threads);
        if (!failed && project(&l->o, s->attn, q_size, s->o, n, width, q_size, threads)) failed = REFUSED_PROJECTION;
        if (!failed) {
            const int64_t last = residual;
            residual = turn, turn ^= 1;
            norm(BUF(last), width, s->o, width, BUF(residual), l->norm2, s->x, n, width, (float)l->eps2, threads);
            if (project(&l->glu, s->x, width, s->act, n, inter, width, threads) ||
                project(&l->down, s->act, inter, s->down, n, width, inter, threads))
                failed = REFUSED_PROJECTION;
        }
        if (failed) {
            s->failed_layer = i;
            s->residual = residual;
            return failed;
        }
    }
#undef BUF
    s->residual = residual;
    return 0;
}
