/* max_pool_u8: a 2-d max pool of channels-last uint8 activations (fxquant/kernels/onednn/max_pool.py).
 *
 * Each output position's channels are the byte-wise maximum of the window's in-bounds input positions, whose
 * channels are adjacent in channels-last memory: a vector compare and blend per 64 channels and tap, the maximum
 * held in registers over the window. A max is exact, so the bytes are torch's. Output rows are split over torch's
 * threads where the work is worth it.
 *
 * Arguments arrive checked (module.c); the function runs without the GIL.
 */
#include <stdint.h>
#include <string.h>

#include "native.h"

/* 64 channels in one value: one zmm in the AVX-512 clone, two ymm in the AVX2 one, four xmm elsewhere. */
typedef uint8_t Block __attribute__((vector_size(64)));
#define BLOCK ((int64_t)sizeof(Block))

/* One output row (n, oh): out_w positions of channels bytes each; the window's rows in bounds are found once, its
 * columns once per position. */
VECTOR_CLONES static void max_row(const uint8_t *x, uint8_t *out, const PoolShape *s, const PoolWindow *w, int64_t n,
                                   int64_t oh) {
    const int64_t channels = s->channels, full = channels - channels % BLOCK;
    const uint8_t *rows[FXQ_POOL_MAX_KERNEL];
    int64_t taps_h = 0;
    for (int64_t kh = 0; kh < w->kernel_h; kh++) {
        const int64_t ih = oh * w->stride_h - w->pad_h + kh * w->dilation_h;
        if (ih >= 0 && ih < s->height) rows[taps_h++] = x + (n * s->height + ih) * s->width * channels;
    }
    for (int64_t ow = 0; ow < s->out_w; ow++) {
        uint8_t *dst = out + ow * channels;
        const int64_t start = ow * w->stride_w - w->pad_w;
        int64_t kw0 = 0, kw1 = w->kernel_w; /* the taps kw0 <= kw < kw1 lie inside the row */
        while (kw0 < kw1 && start + kw0 * w->dilation_w < 0) kw0++;
        while (kw1 > kw0 && start + (kw1 - 1) * w->dilation_w >= s->width) kw1--;
        for (int64_t c0 = 0; c0 < full; c0 += BLOCK) {
            Block acc = {0}; /* uint8's least value: every window has an in-bounds tap */
            for (int64_t t = 0; t < taps_h; t++)
                for (int64_t kw = kw0; kw < kw1; kw++) {
                    Block v;
                    memcpy(&v, rows[t] + (start + kw * w->dilation_w) * channels + c0, sizeof v);
                    const Block greater = (Block)(v > acc); /* all ones where v > acc (unsigned) */
                    acc = (v & greater) | (acc & ~greater);
                }
            memcpy(dst + c0, &acc, sizeof acc);
        }
        for (int64_t c = full; c < channels; c++) {
            uint8_t acc = 0;
            for (int64_t t = 0; t < taps_h; t++)
                for (int64_t kw = kw0; kw < kw1; kw++) {
                    const uint8_t v = rows[t][(start + kw * w->dilation_w) * channels + c];
                    acc = acc > v ? acc : v;
                }
            dst[c] = acc;
        }
    }
}

void fxq_max_pool_u8(const uint8_t *x, uint8_t *out, const PoolShape *s, const PoolWindow *w) {
    const int64_t rows = s->batch * s->out_h, row_bytes = s->out_w * s->channels;
    FXQ_PARALLEL_FOR(rows * row_bytes * w->kernel_h * w->kernel_w >= FXQ_PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) max_row(x, out + r * row_bytes, s, w, r / s->out_h, r % s->out_h);
}
