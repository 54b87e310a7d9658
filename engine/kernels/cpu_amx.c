/* bfloat16 matrix products on AMX tiles, through weights packed once for them.
 *
 * A decode step of a few rows reads every weight once and does little arithmetic on it, so its
 * projections are bound by how fast the weights stream; oneDNN's blocked kernels read them at about
 * two thirds of the memory's speed at these shapes (pdserve bench projections --dtype bfloat16).
 * Here each weight is packed in panels of 32 output columns: for each block of 32 inputs, the
 * panel's two B tiles (16 pairs of inputs x 16 columns x 2, AMX's pair layout) are adjacent, so a
 * panel is one sequential stream. A work item is a panel against up to 32 input rows: two A tiles
 * (16 rows x 32 inputs each) and four accumulator tiles (C, float32) stay on the tile registers
 * while the panel streams past, then the sums get the bias and are rounded to bfloat16 (to nearest
 * even, as torch rounds). Items go panel by panel, all of a panel's row chunks in a row, so a
 * panel read once serves every chunk from the cache.
 *
 * Contract (checked by engine/kernels/cpu_amx.py): x [rows, k] bfloat16 at a row stride, k a
 * multiple of 32; w as cpu_amx.pack lays it out ([ceil(n / 32)][k / 32][2][16][16][2]);
 * bias NULL or n float32; out [rows, n] bfloat16, contiguous. Built without AMX (no -mamx-bf16 from
 * -march=native), the entry points return -1. pdserve_amx_init asks Linux for the tile state once
 * per process (arch_prctl ARCH_REQ_XCOMP_PERM); nothing runs before it returned 0.
 *
 * pdserve_amx_glu is SwiGLU's gate/up product with its activation: w packed by cpu_amx.pack_glu (gate
 * and up rows interleaved 16 at a time, so a panel's two column tiles are 16 gate columns and the same
 * 16 up columns), out [rows, n] = silu(gate) * up, n = the intermediate size, a multiple of 16. Each
 * value is rounded as the unfused path rounds it (the product's sums to bfloat16, then silu to
 * bfloat16, then the product; cpu_ops.c's silu_mul), so the two agree bit for bit; the [rows, 2n]
 * product is never written. bias must be NULL. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int pdserve_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

#define W 16
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
static inline vf splat(float x) { return (vf){} + x; }
#include "cpu_bf16.h" /* vbf16, vround_bf16 */
#include "cpu_vexp.h" /* vsilu */

struct tilecfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* Tiles 0-3: C of row tiles 0 and 1 by column tiles 0 and 1; 4, 5: A of the row tiles; 6, 7: B of
 * the column tiles. A chunk of r0 + r1 rows. */
static void config(int r0, int r1) {
    struct tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = r0;          /* C(m0,n0), C(m0,n1), A(m0) */
    c.rows[2] = c.rows[3] = c.rows[5] = r1 ? r1 : 1; /* C(m1,..), A(m1) */
    c.rows[6] = c.rows[7] = 16;                      /* B(n0), B(n1): 16 k-pairs */
    _tile_loadconfig(&c);
}

/* A quarter of a block's 32 cache lines from `at` (up to `end`) fetched into L2; where the next quarter starts.
 * A tile load that misses the caches waits for all its 16 lines before the products behind it start, so a
 * chunk of 32 rows, with four products a block, read the weights at two thirds of the memory's speed;
 * fetched ahead at the pace of the products, a decode step's projections ran about 1.1x faster
 * (pdserve bench steps --dtype bfloat16). Chunks of 16 rows or fewer already read at the memory's speed. */
#define AHEAD 4 /* blocks */
static inline const char *fetch(const char *at, const char *end) {
    for (int i = 0; i < 8 && at < end; i++, at += 64) _mm_prefetch(at, _MM_HINT_T1);
    return at;
}

/* SwiGLU's epilogue of one item: rows [m0, m0 + m) of panel p, whose sums hold 16 gate columns
 * (buf[i][0..15]) and the same 16 up columns (buf[i][16..31]); out rows are n apart. */
static void glu_epilogue(float (*buf)[32], uint16_t *out, int64_t m0, int64_t m, int64_t p, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        vf g, u;
        memcpy(&g, &buf[i][0], sizeof g);
        memcpy(&u, &buf[i][16], sizeof u);
        const vh a = vbf16(vround_bf16(vsilu(vround_bf16(g))) * vround_bf16(u));
        memcpy(out + (m0 + i) * n + p * 16, &a, sizeof a);
    }
}

/* The product of pdserve_amx_linear (glu 0: n output columns) or pdserve_amx_glu (glu 1: 2n product
 * columns, n outputs). */
static int amx_product(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *out,
                       int64_t rows, int64_t n, int64_t k, int num_threads, int glu) {
    if (k % 32 || (glu && (n % 16 || bias))) return -1;
    const int64_t panels = glu ? n / 16 : (n + 31) / 32, kb = k / 32, chunks = (rows + 31) / 32;
    const char *const end = (const char *)(w + panels * kb * 1024); /* past the last weight */
    #pragma omp parallel num_threads(num_threads)
    {
        float buf[32][32] __attribute__((aligned(64)));
        int cur = -1;
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < panels * chunks; item++) {
            const int64_t p = item / chunks, c = item % chunks, m0 = c * 32;
            const int64_t m = rows - m0 < 32 ? rows - m0 : 32;
            const int r0 = m < 16 ? (int)m : 16, r1 = m > 16 ? (int)(m - 16) : 0;
            if (cur != (int)m) { config(r0, r1); cur = (int)m; }
            const uint16_t *wp = w + p * kb * 1024;
            const uint16_t *xa = x + m0 * x_stride;
            _tile_zero(0); _tile_zero(1);
            if (r1) { _tile_zero(2); _tile_zero(3); }
            /* A chunk of more than 16 rows fetches the weights AHEAD blocks on (into the next panel at its
             * end), a quarter block beside each of its four products: a panel's first chunk only, the
             * others read it from the cache. */
            const char *ahead = r1 && c == 0 ? (const char *)(wp + AHEAD * 1024) : end;
            for (int64_t b = 0; b < kb; b++) {
                _tile_loadd(4, xa + b * 32, x_stride * 2);
                _tile_loadd(6, wp + b * 1024, 64);
                ahead = fetch(ahead, end);
                _tile_loadd(7, wp + b * 1024 + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                ahead = fetch(ahead, end);
                _tile_dpbf16ps(1, 4, 7);
                if (r1) {
                    _tile_loadd(5, xa + 16 * x_stride + b * 32, x_stride * 2);
                    ahead = fetch(ahead, end);
                    _tile_dpbf16ps(2, 5, 6);
                    ahead = fetch(ahead, end);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, &buf[0][0], 128);
            _tile_stored(1, &buf[0][16], 128);
            if (r1) { _tile_stored(2, &buf[16][0], 128); _tile_stored(3, &buf[16][16], 128); }
            if (glu) {
                glu_epilogue(buf, out, m0, m, p, n);
                continue;
            }
            const int64_t cols = n - p * 32 < 32 ? n - p * 32 : 32;
            for (int64_t h = 0; h < cols; h += 16) {
                const __mmask16 mask = (__mmask16)((1u << (cols - h < 16 ? cols - h : 16)) - 1u);
                const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + p * 32 + h) : _mm512_setzero_ps();
                for (int64_t i = 0; i < m; i++)
                    _mm256_mask_storeu_epi16(out + (m0 + i) * n + p * 32 + h, mask,
                                             (__m256i)vbf16((vf)_mm512_add_ps(_mm512_load_ps(&buf[i][h]), bv)));
            }
        }
        if (cur >= 0) _tile_release();
    }
    return 0;
}

int pdserve_amx_linear(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *out,
                       int64_t rows, int64_t n, int64_t k, int num_threads) {
    return amx_product(x, x_stride, w, bias, out, rows, n, k, num_threads, 0);
}

int pdserve_amx_glu(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *out,
                    int64_t rows, int64_t n, int64_t k, int num_threads) {
    return amx_product(x, x_stride, w, bias, out, rows, n, k, num_threads, 1);
}

#else
int pdserve_amx_init(void) { return -1; }
int pdserve_amx_linear(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *out,
                       int64_t rows, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)rows; (void)n; (void)k; (void)num_threads;
    return -1;
}
int pdserve_amx_glu(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *out,
                    int64_t rows, int64_t n, int64_t k, int num_threads) {
    return pdserve_amx_linear(x, x_stride, w, bias, out, rows, n, k, num_threads);
}
#endif
