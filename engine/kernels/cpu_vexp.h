/* e^x on vectors, and silu, for the CPU kernels that include it (cpu_ops.c, cpu_decode.c, cpu_gemm.c,
 * cpu_amx.c). The includer defines the vector types vf (W floats) and vi (W int32s) and splat(), and includes
 * math.h. The build key of a kernel covers the headers beside its source (cpu_build.py), so a change
 * here rebuilds each of them. */

/* e^x for -87 <= x <= 88 (the caller clamps): x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6
 * Taylor polynomial (relative error under 3e-7), 2^n through the exponent bits. */
static inline vf vexp_in_range(vf x) {
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
    return p * (vf)e;
}

/* e^x, x clamped to [-87, 88] (float32's normal range). */
static inline vf vexp(vf x) {
    x = (vf)(((vi)x & (vi)(x > splat(-87.f))) | ((vi)splat(-87.f) & (vi)(x <= splat(-87.f))));
    x = (vf)(((vi)x & (vi)(x < splat(88.f))) | ((vi)splat(88.f) & (vi)(x >= splat(88.f))));
    return vexp_in_range(x);
}
/* e^x, +inf past float32's range (as expf). */
static inline vf vexp_inf(vf x) {
    const vi over = (vi)(x > splat(88.7228f));
    return (vf)(((vi)vexp(x) & ~over) | ((vi)splat(INFINITY) & over));
}

/* silu(x) = x / (1 + e^-x) in float32: SwiGLU's activation, one expression for every kernel that
 * applies it (cpu_ops.c's silu_mul, the fused gate/up products of cpu_gemm.c and cpu_amx.c), so they round
 * alike. */
static inline vf vsilu(vf x) { return x / (splat(1.f) + vexp_inf(-x)); }
