/* splat(x): x in every lane of a vector, for the CPU kernels that include it (cpu_gemm.c, cpu_decode.c,
 * cpu_prefix.c). The includer defines W (floats per vector) and the vector type vf, and includes
 * immintrin.h. Built as a broadcast, which takes x straight from memory where it lies there (one load):
 * GCC builds `(vf){} + x` as a scalar add and a register broadcast, both on the ports the FMAs use, which
 * made the panel kernel's and the decode kernel's inner loops slower (engine/kernels/cpu_gemm.c,
 * cpu_decode.c). Vectors the instruction set has no register for keep the add. */
static inline vf splat(float x) {
#if defined(__AVX512F__) && W == 16
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__) && W == 8
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){} + x;
#endif
}
