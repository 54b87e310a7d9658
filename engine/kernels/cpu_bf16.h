/* bfloat16 lanes to and from float32 vectors, for the CPU kernels that include it (cpu_ops.c,
 * cpu_decode.c, cpu_amx.c). The includer defines W and the vector types vf (W floats), vu (W uint32s) and vh
 * (W uint16s). The build key of a kernel covers the headers beside its source (cpu_build.py), so a
 * change here rebuilds each of them. */

/* AVX-512 widens and narrows 16 lanes in one instruction; GCC lowers __builtin_convertvector between
 * 16-bit and 32-bit lanes as two 256-bit halves. */
#ifdef __AVX512F__
static inline vf widen(vh h) { return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16); }
static inline vh narrow(vu u) { return (vh)_mm512_cvtepi32_epi16((__m512i)u); }
#else
static inline vf widen(vh h) { return (vf)(__builtin_convertvector(h, vu) << 16); }
static inline vh narrow(vu u) { return __builtin_convertvector(u, vh); }
#endif

/* float32 lanes rounded to bfloat16, to nearest even as torch rounds; a NaN stays a (quiet) NaN. */
static inline vh vbf16_int(vf v) {
    const vu u = (vu)v;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    return narrow(((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | ((u >> 16 | 0x40u) & nan));
}
#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* The CPU's own conversion (vcvtneps2bf16, one instruction for what the integer form takes about ten)
 * rounds to nearest even and keeps a NaN quiet as vbf16_int does, but reads a denormal as zero: a vector
 * with a denormal lane (exponent bits all zero, mantissa not) takes the integer form. */
static inline vh vbf16(vf v) {
    const __m512i u = (__m512i)v;
    const __mmask16 denormal = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000))
                             & _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(denormal != 0, 0)) return vbf16_int(v);
    return (vh)_mm512_cvtneps_pbh((__m512)v);
}
#else
static inline vh vbf16(vf v) { return vbf16_int(v); }
#endif

/* float32 lanes rounded to bfloat16 and widened back, as torch rounds an intermediate. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
static inline vf vround_bf16(vf v) { return widen(vbf16(v)); } /* the CPU's conversion and back */
#else
/* Round to bfloat16 and back without leaving 32-bit lanes: the low 16 bits cleared after rounding. */
static inline vf vround_bf16(vf v) {
    const vu u = (vu)v;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    return (vf)((((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u) & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan));
}
#endif
