/* dwconv3x3_onednn: a depthwise 3x3 conv (one input channel per output channel) of stride 1 or 2 on channels-last
 * uint8 on AVX2, for the onednn backend's depthwise convs on CPUs with AVX2 alone, where oneDNN's depthwise kernel
 * sums 3.2-4.4 G products per second on an AMD EPYC Zen 1 against the 16-18 G of its 1x1 convs (MobileNetV2's 17
 * depthwise layers, docs/backends.md, "Depthwise 3x3 convs").
 *
 * Eight channels at a time: the inputs of two taps interleaved and widened to int16 (vpmovzxbw) meet the two taps'
 * int16 weights in vpmaddwd, which sums each channel's pair of products in 32 bits - exact, for 8-bit inputs too
 * (255 * 128 * 2 < 2^31) - five pairs for the nine taps (the tenth tap's weight is 0). A tap outside the image reads
 * the input zero point (a real 0, as oneDNN pads), and `offset` (zx * the channel's weight sum) is subtracted, so the
 * sums are oneDNN's integers; oneDNN's requantization follows (onednn_requant.h): the bytes are the primitive's
 * (tests/kernels/test_onednn_depthwise.py). Output rows are split over torch's threads (each output one thread's
 * arithmetic: the bytes do not depend on the thread count). Arguments arrive checked (module_rows.c); runs without
 * the GIL. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_convs.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "onednn_requant.h"

/* One output pixel's channels: tap[t] points at tap t's input pixel (the zero-point pixel outside the image). Two
 * blocks of eight channels at a time where there are, as two independent chains. */
__attribute__((target("avx2"), always_inline)) static inline __m256i block(const uint8_t *const tap[10],
                                                                          const DwWeights *w, const int64_t c0) {
    const __m256i *weights = (const __m256i *)(const void *)(w->w + c0 * 10);
    __m256i acc = _mm256_setzero_si256();
    for (int p = 0; p < 5; p++) {
        const __m128i a = _mm_loadl_epi64((const __m128i *)(const void *)(tap[2 * p] + c0));
        const __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)(tap[2 * p + 1] + c0));
        const __m256i pairs = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_loadu_si256(weights + p)));
    }
    return _mm256_sub_epi32(acc, _mm256_loadu_si256((const __m256i *)(const void *)(w->offset + c0)));
}

__attribute__((target("avx2"), always_inline)) static inline void pixel(const uint8_t *const tap[10],
                                                                       const DwWeights *w, const OnednnRequant *r,
                                                                       const int64_t c, uint8_t *dst) {
    int64_t c0 = 0;
    for (; c0 + 16 <= c; c0 += 16) {
        const __m256i s0 = block(tap, w, c0), s1 = block(tap, w, c0 + 8);
        fxq_onednn_store8(s0, w->mult + c0, w->bias + c0, r, NULL, dst + c0, 8);
        fxq_onednn_store8(s1, w->mult + c0 + 8, w->bias + c0 + 8, r, NULL, dst + c0 + 8, 8);
    }
    if (c0 < c)
        fxq_onednn_store8(block(tap, w, c0), w->mult + c0, w->bias + c0, r, NULL, dst + c0, 8);
}

__attribute__((target("avx2"))) int fxq_dwconv3x3_avx2(const DwInput *x, const DwWeights *w, const OnednnRequant *r,
                                                        uint8_t *out, const int64_t out_h, const int64_t out_w) {
    const int64_t c = x->c, s = x->stride;
    uint8_t *pad = (uint8_t *)malloc((size_t)c);
    if (pad == NULL)
        return -1;
    memset(pad, (int)x->zx, (size_t)c);
    FXQ_PARALLEL_FOR(x->n * out_h * out_w * c * 9 >= FXQ_PARALLEL_WORK)
    for (int64_t row = 0; row < x->n * out_h; row++) {
        /* local copies: the byte stores could alias *r and *w, which would make every output reload them (a
         * 144-channel 56x56 layer: 0.75 against 0.81 ms) */
        const OnednnRequant requant = *r;
        const DwWeights weights = *w;
        const int64_t image = row / out_h, oy = row % out_h;
        for (int64_t ox = 0; ox < out_w; ox++) {
            const uint8_t *tap[10];
            for (int t = 0; t < 9; t++) {
                const int64_t iy = oy * s - x->pad_h + t / 3, ix = ox * s - x->pad_w + t % 3;
                const int inside = iy >= 0 && iy < x->h && ix >= 0 && ix < x->w;
                tap[t] = inside ? x->data + ((image * x->h + iy) * x->w + ix) * c : pad;
            }
            tap[9] = pad;
            pixel(tap, &weights, &requant, c, out + (row * out_w + ox) * c);
        }
    }
    free(pad);
    return 0;
}

#else /* no x86-64 GNU C: module_rows.c asks fxq_avx2_usable first and never calls the kernel */

int fxq_dwconv3x3_avx2(const DwInput *x, const DwWeights *w, const OnednnRequant *r, uint8_t *out,
                       const int64_t out_h, const int64_t out_w) {
    (void)x; (void)w; (void)r; (void)out; (void)out_h; (void)out_w;
    return 0;
}

#endif
