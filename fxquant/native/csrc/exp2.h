/* exp2_ps: 2^x in 16 float32 lanes, for the attention loops' probabilities (attention.c, full_attention.c). */
#ifndef FXQUANT_EXP2_H
#define FXQUANT_EXP2_H

#include <immintrin.h>

/* 2^x for x <= 0 (every score minus its row's maximum): x = n + f, |f| <= 1/2, 2^f by its degree-6 Taylor
 * polynomial (relative error below 2e-7), times 2^n by scalef; below -126 it flushes to a value the caller masks or
 * that is below float32's normal range anyway. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.69314718056f)); /* f ln 2: e^(f ln 2) */
    __m512 y = _mm512_set1_ps(1.0f / 720.0f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f / 120.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f / 24.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f / 6.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

#endif
