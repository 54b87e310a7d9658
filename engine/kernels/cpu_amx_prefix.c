/* A cascade's shared-prefix attention in bfloat16 on AMX tiles.
 *
 * Every decode sequence of a step reads the same prefix keys, so for each KV head the query rows of all
 * sequences (batch x GQA group) form one matrix against one set of keys: small matrix products,
 * which is what the tiles are for. Per work item (a query head and up to 16 sequences, whose rows sit one
 * sequence stride apart, so the tiles load them where they are):
 *   1. S = Q K^T, the float32 sums of two 16-key tiles at a time (two independent accumulators), into a
 *      buffer of the item's rows;
 *   2. softmax over the row in float32 (the scale, the row's maximum, exp), P = exp(.) rounded to
 *      bfloat16, lse = max + log(sum of the float32 exps);
 *   3. O = P V / sum on the tiles (up to four 16-column accumulators at once), written in float32.
 * The softmax takes two passes over a whole row of scores (each thread's buffers hold 16 rows of the
 * prefix, allocated per call) instead of rescaling the accumulators as an online softmax would.
 *
 * The same call first packs the layer's prefix from the paged cache where asked (cache not NULL), in
 * the same parallel region, so the layer's K and V are in the cache when the items read them: K's
 * 16-key tiles with each key's dim pairs transposed to the tile's pair rows, V's 32-key blocks with each
 * key pair's values interleaved dim by dim (AMX's B-operand layout), keys past the prefix zero.
 *
 * Contract (checked by engine/kernels/cpu_amx_prefix.py): query head g of KV head h of sequence b at
 * q + b * q_stride + (h * group + g) * d, d contiguous bfloat16 values (batch 0: pack only);
 * kp, vp [heads][keys_pad * d] bfloat16, keys_pad a multiple of 32: kp [heads][keys_pad / 16][d / 32]
 * [16 pairs of dims][16 keys][2], vp [heads][keys_pad / 32][d / 16][16 pairs of keys][16 dims][2], the
 * keys past `keys` zero; written by the pack, else already holding the layer; d a multiple of 32,
 * 1 <= keys <= keys_pad; scale > 0; out [heads][group][batch][d] float32, lse [heads][group][batch]
 * float32 (natural log). The pack reads key p of plane 0 (K) or 1 (V), head h at cache + blocks[p /
 * block_size] * block_stride + plane * plane_stride + (p % block_size) * token_stride + h * head_stride
 * (d contiguous values; cache points at the layer's first element), p < keys, each block id in range.
 * pdserve_amx_init (cpu_amx.c) must have returned 0 in this process first; pdserve_amx_prefix_built says
 * whether this build has the kernel (AMX-BF16 and AVX512-BF16 from -march=native). Returns 0; -1
 * without writing where the build has no kernel or the shapes break the contract, and -1 with out and
 * lse unspecified where a row buffer could not be allocated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

int pdserve_amx_prefix_built(void) { return 1; }

#define W 16
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
static inline vf splat(float x) { return (vf){} + x; }
#include "cpu_vexp.h" /* vexp_in_range */

struct tilecfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* Tiles 0, 4: two 16-key tiles of scores; 1: A (query rows, or P); 2, 3: B (K^T, or V); 4-7: the
 * output's accumulators, 16 dims each, once the scores are out. Every tile row is 64 bytes; C and A
 * tiles have m rows. */
static void config(int m) {
    struct tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.colsb[t] = 64; c.rows[t] = (uint8_t)m; }
    c.rows[2] = c.rows[3] = 16;
    _tile_loadconfig(&c);
}

/* One row of scores s (keys_pad of them) into p, its softmax weights' numerators exp(scale * s - max)
 * rounded to bfloat16 (zero past keys); returns 1 / their float32 sum and puts the row's log-sum-exp
 * in *lse. The exponent never exceeds 0 and is clamped below at -87, so exp's result is a normal float
 * (or 1) and the CPU's bfloat16 conversion rounds it as torch does (cpu_bf16.h). */
static float softmax_row(const float *s, uint16_t *p, int64_t keys, int64_t keys_pad, float scale, float *lse) {
    const int64_t full = keys / W * W;
    const __mmask16 tail = (__mmask16)((1u << (keys - full)) - 1u);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += W) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
    if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + full));
    const float top = _mm512_reduce_max_ps(mx) * scale;
    const __m512 sc = _mm512_set1_ps(scale), neg_top = _mm512_set1_ps(-top), floor = _mm512_set1_ps(-87.f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys_pad; j += W) {
        const __m512 x = _mm512_max_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), sc, neg_top), floor);
        __m512 e = (__m512)vexp_in_range((vf)x);
        if (j + W > keys) e = _mm512_maskz_mov_ps(j < keys ? tail : 0, e);
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const float total = _mm512_reduce_add_ps(sum);
    *lse = top + logf(total);
    return 1.f / total;
}

/* Accumulators 4 .. 4 + ng - 1 (ng <= 4) set to P V over every key block, for dim tiles dt .. dt + ng - 1. */
static void pv(const uint16_t *p, int64_t keys_pad, const uint16_t *vh, int64_t d, int64_t dt, int ng) {
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t kb = 0; kb < keys_pad / 32; kb++) {
        const uint16_t *vb = vh + (kb * (d / 16) + dt) * 512;
        _tile_loadd(1, p + kb * 32, keys_pad * 2);
        _tile_loadd(2, vb, 64); _tile_dpbf16ps(4, 1, 2);
        if (ng > 1) { _tile_loadd(3, vb + 512, 64); _tile_dpbf16ps(5, 1, 3); }
        if (ng > 2) { _tile_loadd(2, vb + 1024, 64); _tile_dpbf16ps(6, 1, 2); }
        if (ng > 3) { _tile_loadd(3, vb + 1536, 64); _tile_dpbf16ps(7, 1, 3); }
    }
}

/* Key p's row of the layer, one plane and head in the paged cache, or NULL past the prefix's keys. */
static inline const uint16_t *key_row(const uint16_t *base, const int64_t *blocks, int64_t p, int64_t keys,
                                      int64_t block_size, int64_t block_stride, int64_t token_stride) {
    return p < keys ? base + blocks[p / block_size] * block_stride + (p % block_size) * token_stride : NULL;
}

/* K's tiles of 16 keys from `rows` (NULL: a zero key): for each 32 dims, the 16 keys' dim pairs
 * transposed to 16 pair-rows of 16 keys (one 32-bit word a key). */
static void pack_k_tile(const uint16_t *const rows[16], int64_t d, uint16_t *dst) {
    uint32_t tmp[16][16] __attribute__((aligned(64)));
    uint32_t *out = (uint32_t *)dst;
    for (int64_t c = 0; c < d / 32; c++, out += 256) {
        for (int j = 0; j < 16; j++) {
            if (rows[j]) memcpy(tmp[j], rows[j] + c * 32, 64); else memset(tmp[j], 0, 64);
        }
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) out[i * 16 + j] = tmp[j][i];
    }
}

/* V's block of 32 keys from `rows` (NULL: a zero key): for each 16 dims, 16 rows of the key pair
 * (2i, 2i + 1), their values interleaved dim by dim. */
static void pack_v_block(const uint16_t *const rows[32], int64_t d, uint16_t *dst) {
    for (int64_t dt = 0; dt < d / 16; dt++) {
        for (int i = 0; i < 16; i++, dst += 32) {
            const __m256i a = rows[2 * i] ? _mm256_loadu_si256((const __m256i *)(rows[2 * i] + dt * 16))
                                          : _mm256_setzero_si256();
            const __m256i b = rows[2 * i + 1] ? _mm256_loadu_si256((const __m256i *)(rows[2 * i + 1] + dt * 16))
                                              : _mm256_setzero_si256();
            const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b); /* per 128-bit lane */
            _mm256_storeu_si256((__m256i *)dst, _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256((__m256i *)(dst + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
    }
}

/* The packed K and V of KV head h's 32-key block kb. */
static void pack_block(const uint16_t *cache, int64_t block_stride, int64_t plane_stride, int64_t token_stride,
                       int64_t head_stride, const int64_t *blocks, int64_t block_size, int64_t keys, int64_t keys_pad,
                       int64_t d, int64_t h, int64_t kb, uint16_t *kp, uint16_t *vp) {
    const uint16_t *kbase = cache + h * head_stride, *vbase = kbase + plane_stride;
    const uint16_t *krows[32], *vrows[32];
    for (int j = 0; j < 32; j++) {
        krows[j] = key_row(kbase, blocks, kb * 32 + j, keys, block_size, block_stride, token_stride);
        vrows[j] = key_row(vbase, blocks, kb * 32 + j, keys, block_size, block_stride, token_stride);
    }
    uint16_t *kdst = kp + h * keys_pad * d + kb * 32 * d, *vdst = vp + h * keys_pad * d + kb * 32 * d;
    pack_k_tile(krows, d, kdst);
    pack_k_tile(krows + 16, d, kdst + 16 * d);
    pack_v_block(vrows, d, vdst);
}

int pdserve_amx_prefix_attention(const uint16_t *cache, int64_t block_stride, int64_t plane_stride,
                                 int64_t token_stride, int64_t head_stride, const int64_t *blocks, int64_t block_size,
                                 const uint16_t *q, int64_t q_stride, uint16_t *kp, uint16_t *vp, float *out,
                                 float *lse, int64_t batch, int64_t heads, int64_t group, int64_t keys,
                                 int64_t keys_pad, int64_t d, float scale, int num_threads) {
    if (d % 32 || keys < 1 || keys_pad % 32 || keys > keys_pad || heads < 1 || group < 1 || batch < 0 ||
        (cache && block_size < 1))
        return -1;
    const int64_t row_tiles = (batch + 15) / 16;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        if (cache) { /* the layer's prefix first: every block of it before any item reads it */
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < heads * (keys_pad / 32); item++)
                pack_block(cache, block_stride, plane_stride, token_stride, head_stride, blocks, block_size, keys,
                           keys_pad, d, item / (keys_pad / 32), item % (keys_pad / 32), kp, vp);
        }
        float *s = batch ? aligned_alloc(64, (size_t)(16 * keys_pad) * sizeof(float)) : NULL;
        uint16_t *p = batch ? aligned_alloc(64, (size_t)(16 * keys_pad) * sizeof(uint16_t)) : NULL;
        float acc[16][64] __attribute__((aligned(64)));
        float inv[16];
        int cur = -1;
        if (batch && (!s || !p)) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < heads * group * row_tiles; item++) {
            if (!s || !p) continue;
            /* Query head g of KV head h, sequences b0 .. b0 + m - 1: one row each, q_stride apart. */
            const int64_t hg = item / row_tiles, h = hg / group, b0 = (item % row_tiles) * 16;
            const int m = batch - b0 < 16 ? (int)(batch - b0) : 16;
            if (cur != m) { config(m); cur = m; }
            const uint16_t *qh = q + b0 * q_stride + hg * d, *kh = kp + h * keys_pad * d;
            const int64_t o0 = hg * batch + b0; /* the item's first row of out and lse */
            for (int64_t t = 0; t < keys_pad / 16; t += 2) { /* two key tiles: two independent sums */
                _tile_zero(0);
                _tile_zero(4);
                for (int64_t c = 0; c < d / 32; c++) {
                    _tile_loadd(1, qh + c * 32, q_stride * 2);
                    _tile_loadd(2, kh + (t * (d / 32) + c) * 512, 64);
                    _tile_loadd(3, kh + ((t + 1) * (d / 32) + c) * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                    _tile_dpbf16ps(4, 1, 3);
                }
                _tile_stored(0, s + t * 16, keys_pad * 4);
                _tile_stored(4, s + (t + 1) * 16, keys_pad * 4);
            }
            for (int i = 0; i < m; i++)
                inv[i] = softmax_row(s + i * keys_pad, p + i * keys_pad, keys, keys_pad, scale,
                                     lse + o0 + i);
            for (int64_t dt = 0; dt < d / 16; dt += 4) {
                const int ng = d / 16 - dt < 4 ? (int)(d / 16 - dt) : 4;
                pv(p, keys_pad, vp + h * keys_pad * d, d, dt, ng);
                _tile_stored(4, &acc[0][0], 256);
                _tile_stored(5, &acc[0][16], 256);
                _tile_stored(6, &acc[0][32], 256);
                _tile_stored(7, &acc[0][48], 256);
                for (int i = 0; i < m; i++)
                    for (int g = 0; g < ng; g++)
                        _mm512_storeu_ps(out + (o0 + i) * d + (dt + g) * 16,
                                         _mm512_mul_ps(_mm512_load_ps(&acc[i][g * 16]), _mm512_set1_ps(inv[i])));
            }
        }
        if (cur >= 0) _tile_release();
        free(s);
        free(p);
    }
    return failed ? -1 : 0;
}

#else
int pdserve_amx_prefix_built(void) { return 0; }
int pdserve_amx_prefix_attention(const uint16_t *cache, int64_t block_stride, int64_t plane_stride,
                                 int64_t token_stride, int64_t head_stride, const int64_t *blocks, int64_t block_size,
                                 const uint16_t *q, int64_t q_stride, uint16_t *kp, uint16_t *vp, float *out,
                                 float *lse, int64_t batch, int64_t heads, int64_t group, int64_t keys,
                                 int64_t keys_pad, int64_t d, float scale, int num_threads) {
    (void)cache; (void)block_stride; (void)plane_stride; (void)token_stride; (void)head_stride; (void)blocks;
    (void)block_size; (void)q; (void)q_stride; (void)kp; (void)vp; (void)out; (void)lse; (void)batch; (void)heads;
    (void)group; (void)keys; (void)keys_pad; (void)d; (void)scale; (void)num_threads;
    return -1;
}
#endif
