/* The element-wise loops on int8 activations, each the torch path's arithmetic in one pass:
 *
 * quantize_f32: float32 -> uint8/int8 activations (fxquant/kernels/plain_int8.py), optionally NCHW -> NHWC.
 * mean_u8: the global average pool of uint8 activations (fxquant/kernels/plain_int8.py), in integers.
 * mul_u8: the product of two uint8 activations (an SE gate), rounded once (fxquant/kernels/plain_int8.py).
 * lookup_u8: a 256-entry table applied to every byte (an element-wise function of int8 values, fxquant/nn/lookup.py).
 * copy_rows: rows of bytes between two strided layouts (a channel concat of channels-last activations).
 * quantize_rows_s8, rescale_rows: the per-token quantize (optionally of SmoothQuant-scaled rows) and int32-to-float
 *   rescale around torch._int_mm (fxquant/kernels/per_token.py), their rows split over torch's threads (a prefill's
 *   hundreds; FXQ_PARALLEL_FOR); int8_rows.c quantizes with the former.
 *
 * Arguments arrive checked (module.c); every function here runs without the GIL.
 */
#include <math.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* round(v) half to even for |v| <= 2**22 in the default rounding mode, without SSE4.1's roundps: adding and
 * subtracting 1.5 * 2**23 leaves no fraction bits (the compiler may not fold it: no -ffast-math). */
static inline float round_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

/* q = clamp(round(x / scale) + zero_point, qmin, qmax), as fxquant.qparams.quantize computes it in float32. The
 * quotient is first clamped to one step beyond the range (so rounding stays exact and NaN becomes qmin), then rounded
 * and clamped to it: the same result for every finite x. */
static inline float quantized(float x, float scale, float lo, float hi) {
    float v = x / scale;
    v = v > lo - 1.0f ? v : lo - 1.0f;
    v = v < hi + 1.0f ? v : hi + 1.0f;
    v = round_even(v);
    v = v > lo ? v : lo;
    return v < hi ? v : hi;
}

#define QUANT_BLOCK 256
#define QUANT_FEW 4 /* channel counts whose NHWC interleave is written out: an image's gray+alpha, RGB, RGBA */

/* The bytes of a value quantized with zero point zp: the same bits whether out is uint8 or int8. */
static inline uint8_t quantized_byte(float x, float scale, float lo, float hi, int zp) {
    return (uint8_t)((int)quantized(x, scale, lo, hi) + zp);
}

/* dst[i * channels + c] = planes[c][i] for i < len: NHWC from per-channel blocks. Inlined with channels a constant
 * (interleave, below), the inner loop unrolls into one pattern per position (the compiler's permutes). */
__attribute__((always_inline)) static inline void interleave_as(uint8_t planes[][QUANT_BLOCK], uint8_t *dst,
                                                                int64_t len, const int64_t channels) {
    for (int64_t i = 0; i < len; i++)
        for (int64_t c = 0; c < channels; c++) dst[i * channels + c] = planes[c][i];
}

/* interleave_as for 2-4 channels, each its own specialization (the caller hands wider inputs over in groups of
 * QUANT_FEW channels, each stored channel by channel). */
static inline void interleave(uint8_t planes[][QUANT_BLOCK], uint8_t *dst, int64_t len, int64_t channels) {
    switch (channels) {
    case 2:
        interleave_as(planes, dst, len, 2);
        return;
    case 3:
        interleave_as(planes, dst, len, 3);
        return;
    case 4:
        interleave_as(planes, dst, len, 4);
        return;
    default:
        interleave_as(planes, dst, len, channels);
    }
}

/* The loops of quantize_f32 (below). With to_nhwc, each block of positions is quantized channel by channel into
 * bytes (contiguous, so vectorized), then interleaved: a float-to-int conversion per strided byte store cost ~5x
 * the contiguous pass on a 3-channel image. */
VECTOR_CLONES static void quantize_loop(const float *x, void *out, int64_t outer, int64_t channels, int64_t inner,
                                        float scale, float lo, float hi, int zp, int to_nhwc) {
    uint8_t *bytes = (uint8_t *)out;
    if (!to_nhwc) {
        const int64_t total = outer * channels * inner;
        for (int64_t i = 0; i < total; i++) bytes[i] = quantized_byte(x[i], scale, lo, hi, zp);
        return;
    }
    uint8_t planes[QUANT_FEW][QUANT_BLOCK];
    const int64_t group = channels < QUANT_FEW ? channels : QUANT_FEW;
    for (int64_t n = 0; n < outer; n++) {
        for (int64_t begin = 0; begin < inner; begin += QUANT_BLOCK) {
            const int64_t len = inner - begin < QUANT_BLOCK ? inner - begin : QUANT_BLOCK;
            uint8_t *dst = bytes + (n * inner + begin) * channels;
            for (int64_t first = 0; first < channels; first += group) {
                const int64_t count = channels - first < group ? channels - first : group;
                for (int64_t c = 0; c < count; c++) {
                    const float *src = x + (n * channels + first + c) * inner + begin;
                    for (int64_t i = 0; i < len; i++) planes[c][i] = quantized_byte(src[i], scale, lo, hi, zp);
                }
                if (count == channels)
                    interleave(planes, dst, len, channels);
                else
                    for (int64_t c = 0; c < count; c++)
                        for (int64_t i = 0; i < len; i++) dst[i * channels + first + c] = planes[c][i];
            }
        }
    }
}

/* x: outer * channels * inner dense float32 values in that order (NCHW: outer = N, inner = H * W); out: as many
 * bytes (uint8 or int8: the bits of q are the same for both), in the same order, or with to_nhwc in outer * inner *
 * channels order (NHWC, i.e. torch.channels_last memory). One read and one write per value, where torch needs a pass per step and a
 * separate NCHW -> NHWC copy. */
void fxq_quantize_f32(const float *x, void *out, const Planes *shape, const QuantizeParams *q, int to_nhwc) {
    const float fscale = (float)q->scale, lo = (float)(q->qmin - q->zero_point), hi = (float)(q->qmax - q->zero_point);
    quantize_loop(x, out, shape->outer, shape->channels, shape->inner, fscale, lo, hi, (int)q->zero_point, to_nhwc);
}

/* round_half_even(total / count) for count > 0, in integers (floor division, then the remainder decides). */
static inline int64_t divide_half_even(int64_t total, int64_t count) {
    int64_t q = total / count, r = total % count;
    if (r < 0) {
        q -= 1;
        r += count;
    }
    if (2 * r > count || (2 * r == count && (q & 1))) q += 1;
    return q;
}

/* The loops of mean_u8 (below). sums: channels counters. */
VECTOR_CLONES static void mean_loop(const uint8_t *x, uint8_t *out, uint32_t *sums, int64_t outer, int64_t channels,
                                    int64_t inner, int64_t s_outer, int64_t s_channel, int64_t s_inner, int zp,
                                    int qmin, int qmax) {
    for (int64_t n = 0; n < outer; n++) {
        const uint8_t *base = x + n * s_outer;
        memset(sums, 0, (size_t)channels * sizeof(uint32_t));
        if (s_channel == 1) /* channels-last: each position's channels are adjacent */
            for (int64_t i = 0; i < inner; i++) {
                const uint8_t *row = base + i * s_inner;
                for (int64_t c = 0; c < channels; c++) sums[c] += row[c];
            }
        else
            for (int64_t c = 0; c < channels; c++) {
                const uint8_t *plane = base + c * s_channel;
                uint32_t total = 0;
                for (int64_t i = 0; i < inner; i++) total += plane[i * s_inner];
                sums[c] = total;
            }
        for (int64_t c = 0; c < channels; c++) {
            int64_t v = divide_half_even((int64_t)sums[c] - inner * zp, inner) + zp;
            out[n * channels + c] = (uint8_t)(v < qmin ? qmin : v > qmax ? qmax : v);
        }
    }
}

/* x: uint8 values at x[n * s.outer + c * s.channel + i * s.inner] (strides in elements); out: outer * channels dense
 * uint8, out[n, c] = clamp(round_half_even(mean_i(x[n, c, i]) - zero_point) + zero_point, qmin, qmax): the rounded
 * mean of the centered integers, as fxquant's adaptive average pool defines it, computed exactly (a 32-bit sum per
 * channel, one division) where torch needs a float copy, the pool and four passes of requantization. */
int fxq_mean_u8(const uint8_t *x, uint8_t *out, const Planes *shape, const PlaneStrides *strides,
                const ByteLevels *levels) {
    uint32_t *sums = (uint32_t *)malloc((size_t)shape->channels * sizeof(uint32_t));
    if (sums == NULL) return -1;
    mean_loop(x, out, sums, shape->outer, shape->channels, shape->inner, strides->outer, strides->channel,
              strides->inner, (int)levels->zero_point, (int)levels->qmin, (int)levels->qmax);
    free(sums);
    return 0;
}

/* The loops of mul_u8 (below): float32 or float64 arithmetic, as PlainInt8Backend.mul does it.
 * Rows along the last dimension; the two common rows get unit-stride loops the compiler vectorizes: all three tensors
 * dense along the row (channels-last, or same-shape operands), or b constant along it (an SE gate on NCHW). */
#define MUL_VALUE(REAL, RINT, VA, VB)                                                                                \
    do {                                                                                                             \
        REAL v_ = RINT((REAL)((int)(VA) - za) * ((REAL)((int)(VB) - zb) * factor));                                 \
        v_ = v_ > lo ? v_ : lo;                                                                                      \
        v_ = v_ < hi ? v_ : hi;                                                                                      \
        value = (uint8_t)((int)v_ + zo);                                                                             \
    } while (0)
#define MUL_LOOP(NAME, REAL, RINT)                                                                                   \
    VECTOR_CLONES static void NAME(const uint8_t *a, const uint8_t *b, uint8_t *out, const int64_t *shape,          \
                                   const int64_t *sa, const int64_t *sb, const int64_t *so, int za, int zb, int zo,  \
                                   int qmin, int qmax, double k) {                                                  \
        const REAL factor = (REAL)k, lo = (REAL)(qmin - zo), hi = (REAL)(qmax - zo);                                 \
        const int64_t len = shape[2];                                                                                \
        uint8_t value;                                                                                               \
        for (int64_t n = 0; n < shape[0]; n++)                                                                       \
            for (int64_t r = 0; r < shape[1]; r++) {                                                                 \
                const uint8_t *pa = a + n * sa[0] + r * sa[1], *pb = b + n * sb[0] + r * sb[1];                     \
                uint8_t *po = out + n * so[0] + r * so[1];                                                           \
                if (sa[2] == 1 && sb[2] == 1 && so[2] == 1) {                                                        \
                    for (int64_t i = 0; i < len; i++) {                                                              \
                        MUL_VALUE(REAL, RINT, pa[i], pb[i]);                                                         \
                        po[i] = value;                                                                               \
                    }                                                                                                \
                } else if (sa[2] == 1 && sb[2] == 0 && so[2] == 1) {                                                 \
                    const uint8_t gate = pb[0];                                                                      \
                    for (int64_t i = 0; i < len; i++) {                                                              \
                        MUL_VALUE(REAL, RINT, pa[i], gate);                                                          \
                        po[i] = value;                                                                               \
                    }                                                                                                \
                } else {                                                                                             \
                    for (int64_t i = 0; i < len; i++) {                                                              \
                        MUL_VALUE(REAL, RINT, pa[i * sa[2]], pb[i * sb[2]]);                                         \
                        po[i * so[2]] = value;                                                                       \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
    }
MUL_LOOP(mul_loop_f32, float, rintf)
MUL_LOOP(mul_loop_f64, double, rint)

/* Element [n, r, i] of each uint8 tensor lies at data[n * stride[0] + r * stride[1] + i * stride[2]] (strides in
 * elements; 0 where b is broadcast, e.g. an SE gate of shape (N, C, 1, 1)); the caller puts the dimension with the
 * smallest strides last (channels for channels-last tensors). out = clamp(rint((a - za) * ((b - zb) * factor)) + zo,
 * qmin, qmax), each product rounded in float32 (float64 if wide) in that order, factor rounded to that type first:
 * the operations fxquant's torch path runs, so the results are the same bits, in one pass instead of seven. */
void fxq_mul_u8(const int64_t shape[3], const Bytes3 *a, const Bytes3 *b, const Bytes3 *out, const MulRequant *r) {
    if (r->wide)
        mul_loop_f64(a->data, b->data, out->data, shape, a->stride, b->stride, out->stride, (int)r->za, (int)r->zb,
                     (int)r->zo, (int)r->qmin, (int)r->qmax, r->factor);
    else
        mul_loop_f32(a->data, b->data, out->data, shape, a->stride, b->stride, out->stride, (int)r->za, (int)r->zb,
                     (int)r->zo, (int)r->qmin, (int)r->qmax, r->factor);
}

/* dst[i] = table[src[i]] over n bytes. With AVX512-VBMI, 64 bytes per step: two 128-entry permutes (the index's low
 * seven bits pick within each half of the table) and a blend on its top bit; elsewhere one byte at a time (still one
 * pass where dequantize -> function -> quantize takes three). */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void lookup_vbmi(const uint8_t *src, uint8_t *dst,
                                                                              int64_t n, const uint8_t *table) {
    const __m512i t0 = _mm512_loadu_si512(table), t1 = _mm512_loadu_si512(table + 64),
                  t2 = _mm512_loadu_si512(table + 128), t3 = _mm512_loadu_si512(table + 192);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m512i x = _mm512_loadu_si512(src + i);
        const __m512i low = _mm512_permutex2var_epi8(t0, x, t1), high = _mm512_permutex2var_epi8(t2, x, t3);
        _mm512_storeu_si512(dst + i, _mm512_mask_blend_epi8(_mm512_movepi8_mask(x), low, high));
    }
    for (; i < n; i++)
        dst[i] = table[src[i]];
}
#define HAVE_VBMI_LOOKUP 1
#endif

void fxq_lookup_u8(const uint8_t *src, uint8_t *dst, int64_t n, const uint8_t *table) {
#ifdef HAVE_VBMI_LOOKUP
    if (fxq_isa_cap >= ISA_AVX512 && __builtin_cpu_supports("avx512vbmi"))
        lookup_vbmi(src, dst, n, table);
    else
#endif
        for (int64_t i = 0; i < n; i++)
            dst[i] = table[src[i]];
}

/* rows rows of width bytes. A channel concat of channels-last activations is one such copy per input (rows: the
 * pixels, width: its channels), where torch's cat interleaves the inputs one element at a time. With AVX512-BW one
 * masked 64-byte move per row up to 64 bytes, 64-byte steps beyond. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512bw"))) static void copy_rows_avx512(const uint8_t *src, int64_t ss, uint8_t *dst,
                                                                          int64_t ds, int64_t rows, int64_t width) {
    const int64_t full = width / 64, tail = width % 64;
    const __mmask64 mask = tail ? (((__mmask64)1 << tail) - 1) : 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *s = src + r * ss;
        uint8_t *d = dst + r * ds;
        for (int64_t j = 0; j < full; j++)
            _mm512_storeu_si512(d + 64 * j, _mm512_loadu_si512(s + 64 * j));
        if (tail)
            _mm512_mask_storeu_epi8(d + 64 * full, mask, _mm512_maskz_loadu_epi8(mask, s + 64 * full));
    }
}
#define HAVE_AVX512_COPY 1
#endif

void fxq_copy_rows(const ByteRows *src_rows, const ByteRows *dst_rows, int64_t rows, int64_t width) {
    const uint8_t *src = src_rows->data;
    uint8_t *dst = dst_rows->data;
    const int64_t ss = src_rows->stride, ds = dst_rows->stride;
#ifdef HAVE_AVX512_COPY
    if (fxq_isa_cap >= ISA_AVX512 && __builtin_cpu_supports("avx512bw"))
        copy_rows_avx512(src, ss, dst, ds, rows, width);
    else
#endif
        for (int64_t r = 0; r < rows; r++)
            memcpy(dst + r * ds, src + r * ss, (size_t)width);
}

/* One row of fxq_quantize_groups (below), any CPU (the AVX2 clone vectorizes the quantize, not the max). */
VECTOR_CLONES static void quantize_row_scalar(const float *row, int64_t width, const float *input_scale, int offset,
                                              uint8_t *q, float *scale) {
    float amax = 0.0f;
    if (input_scale)
        for (int64_t k = 0; k < width; k++) {
            const float y = row[k] * input_scale[k], a = y < 0.0f ? -y : y;
            amax = a > amax ? a : amax;
        }
    else
        for (int64_t k = 0; k < width; k++) {
            const float a = row[k] < 0.0f ? -row[k] : row[k];
            amax = a > amax ? a : amax;
        }
    const float s = amax / 127.0f, rs = s > FLT_MIN ? s : FLT_MIN;
    *scale = rs;
    if (input_scale)
        for (int64_t k = 0; k < width; k++)
            q[k] = (uint8_t)((int)quantized(row[k] * input_scale[k], rs, -127.0f, 127.0f) + offset);
    else
        for (int64_t k = 0; k < width; k++) q[k] = (uint8_t)((int)quantized(row[k], rs, -127.0f, 127.0f) + offset);
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The same row in 16 lanes, each operation rounded as the scalar one: max and min ignore NaN where the scalar
 * comparisons do (a NaN first operand yields the second), roundscale rounds half to even like round_even. */
__attribute__((target("avx512f,avx512bw"))) static inline __m512 scaled_lanes(const float *row, const float *input_scale,
                                                                             int64_t k, __mmask16 mask) {
    const __m512 y = _mm512_maskz_loadu_ps(mask, row + k);
    return input_scale ? _mm512_mul_ps(y, _mm512_maskz_loadu_ps(mask, input_scale + k)) : y;
}

__attribute__((target("avx512f,avx512bw"))) static void quantize_row_avx512(const float *row, int64_t width,
                                                                           const float *input_scale, int offset,
                                                                           uint8_t *q, float *scale) {
    __m512 amax = _mm512_setzero_ps(); /* masked-off lanes load 0, which changes no maximum of magnitudes */
    for (int64_t k = 0; k < width; k += 16) {
        const __mmask16 mask = width - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (width - k)) - 1u);
        amax = _mm512_max_ps(_mm512_abs_ps(scaled_lanes(row, input_scale, k, mask)), amax);
    }
    const float s = _mm512_reduce_max_ps(amax) / 127.0f, rs = s > FLT_MIN ? s : FLT_MIN;
    *scale = rs;
    const __m512 vs = _mm512_set1_ps(rs), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 below = _mm512_set1_ps(-128.0f), above = _mm512_set1_ps(128.0f);
    const __m512i shift = _mm512_set1_epi32(offset);
    for (int64_t k = 0; k < width; k += 16) {
        const __mmask16 mask = width - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (width - k)) - 1u);
        __m512 v = _mm512_div_ps(scaled_lanes(row, input_scale, k, mask), vs);
        v = _mm512_min_ps(_mm512_max_ps(v, below), above);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i level = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
        _mm512_mask_cvtepi32_storeu_epi8(q + k, mask, _mm512_add_epi32(level, shift)); /* truncated to a byte */
    }
}
#define HAVE_AVX512_QUANTIZE_ROWS 1
#endif

/* Symmetric int8 per group of `group` consecutive values of each row (dynamic per-token activations where group is
 * the width, per-group ones below it) of y = x * input_scale (per column; x itself where input_scale is NULL):
 * scale = max(max |y| / 127, FLT_MIN) over the group and level = clamp(round(y / scale), -127, 127), as
 * fxquant.kernels.per_token.quantize_rows computes them (y rounded once, as torch's mul rounds it; computed in both
 * passes, the same bits each time). Stored as the byte level + offset (0: int8; 128: the unsigned bytes vpdpbusd
 * reads) laid out (groups, rows, group), scales (groups, rows). Each thread takes whole rows, read in order (a
 * group-major walk over a wide row-major input strides by a row per step: 4x slower on 2048 columns). With
 * AVX-512, 16 values per step: the compiler keeps the scalar maximum's NaN rule by leaving that loop scalar, a pass
 * as slow as the rest together. */
void fxq_quantize_groups(const float *x, int64_t rows, int64_t width, int64_t x_stride, const float *input_scale,
                         int64_t group, int offset, uint8_t *q, float *scale) {
    const int64_t groups = width / group;
    void (*quantize_row)(const float *, int64_t, const float *, int, uint8_t *, float *) = quantize_row_scalar;
#ifdef HAVE_AVX512_QUANTIZE_ROWS
    if (fxq_isa_cap >= ISA_AVX512 && __builtin_cpu_supports("avx512bw"))
        quantize_row = quantize_row_avx512;
#endif
    FXQ_PARALLEL_FOR(rows * width >= FXQ_PARALLEL_WORK)
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++)
            quantize_row(x + m * x_stride + g * group, group, input_scale ? input_scale + g * group : NULL, offset,
                         q + (g * rows + m) * group, scale + g * rows + m);
}

void fxq_quantize_rows_s8(const float *x, int64_t rows, int64_t width, int64_t x_stride, const float *input_scale,
                          int8_t *q, float *scale) {
    fxq_quantize_groups(x, rows, width, x_stride, input_scale, width, 0, (uint8_t *)q, scale);
}

/* out[m, n] = float(acc[m, n]) * row_scale[m] * col_scale[n] (+ bias[n]), rounded after each operation as torch's
 * mul_/mul_/add_ round. */
VECTOR_CLONES void fxq_rescale_rows(const int32_t *acc, int64_t rows, int64_t width, const float *row_scale,
                                    const float *col_scale, const float *bias, float *out) {
    FXQ_PARALLEL_FOR(rows * width >= FXQ_PARALLEL_WORK)
    for (int64_t m = 0; m < rows; m++) {
        const int32_t *a = acc + m * width;
        float *o = out + m * width;
        const float rs = row_scale[m];
        if (bias)
            for (int64_t n = 0; n < width; n++) o[n] = (float)a[n] * rs * col_scale[n] + bias[n];
        else
            for (int64_t n = 0; n < width; n++) o[n] = (float)a[n] * rs * col_scale[n];
    }
}
