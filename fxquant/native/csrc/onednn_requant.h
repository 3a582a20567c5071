/* oneDNN's requantization of eight output channels' int32 sums, as fxquant's onednn backend configures its
 * primitives (OnednnRequant): shared by the AVX2 row loop (rows_avx2.c), the Winograd conv (winograd_avx2.c) and the
 * depthwise conv (depthwise_avx2.c).
 * x86-64 GNU C only; built with -ffp-contract=off, so each float operation rounds where oneDNN's does. */
#ifndef FXQUANT_ONEDNN_REQUANT_H
#define FXQUANT_ONEDNN_REQUANT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

/* f = float(sums) * mult + bias (not fused: oneDNN multiplies, then adds); with `sum`, f += scale * (float(dst
 * before) - zp), oneDNN's sum post-op reading the destination; then max(f, 0) with relu. float_out stores f, else
 * rint(f * dst_inv + zo) saturated in float to [0, qmax] (a sum beyond int32 stays qmax): n of the eight outputs
 * stored at dst (bytes or float32). The order was pinned by emulating candidates against oneDNN's primitives
 * (tests/kernels/test_onednn_rows.py, test_onednn_winograd.py, test_onednn_depthwise.py compare bytes). */
__attribute__((target("avx2"), always_inline)) static inline void fxq_onednn_store8(
    const __m256i sums, const float *mult, const float *bias, const OnednnRequant *r, const OnednnSum *sum,
    uint8_t *dst, const int64_t n) {
    const int64_t stored = n < 8 ? n : 8;
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(mult));
    f = _mm256_add_ps(f, _mm256_loadu_ps(bias));
    if (sum != NULL) {
        __m128i before;
        if (stored == 8) {
            before = _mm_loadl_epi64((const __m128i *)dst);
        } else {
            uint8_t tail[16] = {0};
            memcpy(tail, dst, (size_t)stored);
            before = _mm_loadl_epi64((const __m128i *)tail);
        }
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(before));
        f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_set1_ps(sum->scale),
                                           _mm256_sub_ps(q, _mm256_set1_ps((float)sum->zero_point))));
    }
    if (r->relu)
        f = _mm256_max_ps(f, _mm256_setzero_ps());
    if (r->float_out) {
        if (stored == 8) {
            _mm256_storeu_ps((float *)(void *)dst, f);
        } else {
            float values[8];
            _mm256_storeu_ps(values, f);
            memcpy(dst, values, sizeof(float) * (size_t)stored);
        }
        return;
    }
    f = _mm256_add_ps(_mm256_mul_ps(f, _mm256_set1_ps(r->dst_inv)), _mm256_set1_ps((float)r->zo));
    f = _mm256_min_ps(_mm256_max_ps(f, _mm256_setzero_ps()), _mm256_set1_ps((float)r->qmax));
    const __m256i q = _mm256_cvtps_epi32(f);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    const __m128i packed = _mm_packus_epi16(words, words);
    if (stored == 8) { /* (a memcpy of a variable size is a library call: most of the cost of a store) */
        _mm_storel_epi64((__m128i *)dst, packed);
    } else {
        uint8_t bytes[16];
        _mm_storeu_si128((__m128i *)bytes, packed);
        memcpy(dst, bytes, (size_t)stored);
    }
}

#endif
