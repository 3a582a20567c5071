/* The onednn backend's AVX2 conv loops (CPUs with AVX2 alone), with oneDNN's requantization (onednn_requant.h):
 *   winograd_avx2.c  conv3x3_onednn: a 3x3 conv of stride 1 as Winograd F(2x2, 3x3) (fxquant/native/winograd.py)
 *   depthwise_avx2.c dwconv3x3_onednn: a depthwise 3x3 conv (fxquant/native/depthwise.py)
 * module_rows.c checks their arguments. */
#ifndef FXQUANT_AVX2_CONVS_H
#define FXQUANT_AVX2_CONVS_H

#include "native.h"

/* ---- winograd_avx2.c ---- */

/* A 3x3 conv of stride 1, dilation 1 and one group on channels-last uint8 (n, h, w, c), contiguous, padded by
 * (pad_h, pad_w) with the zero point zx. */
typedef struct {
    const uint8_t *data;
    int64_t n, h, w, c, pad_h, pad_w, zx;
} WinoInput;

/* Its weights transformed for Winograd F(2x2, 3x3): u = (2G) g (2G)^T, int16, laid out (16, k16 / 16, c16 / 2, 16,
 * 2): for each of the 16 points, blocks of 16 outputs x 2 inputs per 64 bytes (zeros past c and out_channels);
 * mult (s_x * s_w) and bias per output, k16 floats each. */
typedef struct {
    const int16_t *u;
    const float *mult, *bias;
    int64_t c16, k16, out_channels;
} WinoWeights;

/* The conv's int32 sums (exact: the same integers as oneDNN's, for c up to 1827 channels of 8-bit inputs) requantized
 * as oneDNN's primitive (fxq_onednn_store8) into the channels-last uint8 output (n, out_h, out_w, out_channels), the
 * sum post-op's accumulator read from it where `sum` is not NULL. Only where fxq_avx2_usable(). -1: no memory for
 * the scratch (some outputs not written), else 0. */
FXQ_INTERNAL int fxq_conv3x3_winograd_avx2(const WinoInput *x, const WinoWeights *w, const OnednnRequant *r,
                                           const OnednnSum *sum, uint8_t *out, int64_t out_h, int64_t out_w);

/* ---- depthwise_avx2.c ---- */

/* A depthwise 3x3 conv's channels-last uint8 input (n, h, w, c), c a multiple of 8, with its padding (0 or 1), stride
 * (1 or 2) and zero point (what the padding reads as). */
typedef struct {
    const uint8_t *data;
    int64_t n, h, w, c, pad_h, pad_w, stride, zx;
} DwInput;

/* Its int8 weights as int16, laid out (c / 8, 5, 8, 2): per block of eight channels, five pairs of taps (t = 3 kh + kw;
 * the tenth tap 0) interleaved channel by channel; offset: zx times each channel's weight sum (int32); mult (s_x *
 * s_w) and bias per channel, c floats each. */
typedef struct {
    const int16_t *w;
    const int32_t *offset;
    const float *mult, *bias;
} DwWeights;

/* The conv's int32 sums (oneDNN's integers exactly) requantized as oneDNN's primitive (fxq_onednn_store8) into the
 * channels-last uint8 output (n, out_h, out_w, c). Only where fxq_avx2_usable(). -1: no memory for the padding
 * pixel (nothing written), else 0. */
FXQ_INTERNAL int fxq_dwconv3x3_avx2(const DwInput *x, const DwWeights *w, const OnednnRequant *r, uint8_t *out,
                                    int64_t out_h, int64_t out_w);

#endif
