/* A copy that bypasses the cache on its stores (non-temporal), for bytes that land in a KV cache.

A KV pull copies each received block once into the cache. With ordinary stores every destination
line is first read into the cache (read-for-ownership) and later written back: three memory
transfers per line. Streaming stores write the line without reading it: two. glibc's memcpy
streams only above a threshold of a large fraction of the last-level cache (tens of MiB), far
above a block, so a block-sized memcpy pays the read.

pdserve_stream_copy(dst, src, n): copies n bytes; the ranges must not overlap. The destination's
bytes are in memory (not only in this core's store buffers) when it returns. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PDSERVE_X86 1
#endif

void pdserve_stream_copy(void *dst, const void *src, int64_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    if (n <= 0) return;
    int64_t head = (int64_t)((64 - ((uintptr_t)d & 63)) & 63); /* streaming stores want aligned lines */
    if (head > n) head = n;
    memcpy(d, s, (size_t)head);
    d += head;
    s += head;
    n -= head;
#if defined(PDSERVE_X86) && defined(__AVX512F__)
    for (; n >= 256; n -= 256, d += 256, s += 256) {
        __m512i a = _mm512_loadu_si512((const void *)s), b = _mm512_loadu_si512((const void *)(s + 64));
        __m512i c = _mm512_loadu_si512((const void *)(s + 128)), e = _mm512_loadu_si512((const void *)(s + 192));
        _mm512_stream_si512((void *)d, a);
        _mm512_stream_si512((void *)(d + 64), b);
        _mm512_stream_si512((void *)(d + 128), c);
        _mm512_stream_si512((void *)(d + 192), e);
    }
#elif defined(PDSERVE_X86) && defined(__AVX2__)
    for (; n >= 128; n -= 128, d += 128, s += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s), b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64)), e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
    }
#endif
    memcpy(d, s, (size_t)n);
#if defined(PDSERVE_X86) && defined(__SSE2__)
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before the caller goes on */
#endif
}
