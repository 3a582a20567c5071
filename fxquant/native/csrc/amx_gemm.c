/* The int8 GEMMs that stand in for the engines' convs and Linears, each giving the engine's bytes:
 *
 * conv_u8: a 1-, 2- or 3-d conv as fbgemm or qnnpack computes it, on AMX tiles.
 * linear_rows_u8: a Linear on a few rows with the conv loop's requantization, on AVX512-VNNI.
 * fxq_vnni_usable / fxq_amx_usable: whether the cap and the CPU allow these loops and patches.c's.
 *
 * Arguments arrive checked (module.c), which asks fxq_vnni_usable / fxq_amx_usable first; every kernel here runs
 * without the GIL. Where they are used, and what they gain: docs/amx.md.
 */
#define _GNU_SOURCE 1 /* syscall(), for the AMX tile permission */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gemm.h"

/* Linux grants the AMX tile state to a process on request (arch_prctl); where it does not, no tile loop runs. */
static int amx_usable(void) {
    static int usable = -1;
    if (fxq_isa_cap < ISA_AMX)
        return 0;
    if (usable < 0) {
        unsigned int a, b, c, d;
        usable = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25)) &&
                 syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return usable;
}

/* conv_u8: a conv (1, 2 or 3-d; groups 1, dilation 1) on AMX tiles, computing what fbgemm's (or qnnpack's) quantized
 * conv computes (tests/kernels/test_conv_native.py compares them bit for bit): exact int32 sums of u8*s8 products,
 * minus the input zero point times each output channel's weight sum, then the engine's per-channel requantization -
 * fbgemm: (float(acc) + bias / (s_x * s_w)) * multiplier; qnnpack: float(acc + int32 bias) * multiplier - rounded to
 * nearest even, saturated to int16, plus the output zero point, saturated to [0, qmax] ([zo, qmax] with a ReLU;
 * qmax 255, or 127 for 7-bit activations, where the engine's op is followed by a clamp).
 * fbgemm builds an im2col copy per call and runs few-channel convs slowly (docs/amx.md); this runs them as an
 * implicit GEMM: the input is copied once into a buffer padded with its zero point, where one kernel row's inputs
 * for one output position - kw * C bytes - lie together, so each 16x16 int32 tile of output positions x channels
 * sums kernel row by kernel row, up to 64 bytes at a time. Every shape is (N, D, H, W, C): a 2-d conv has depth 1, a
 * 1-d conv height 1 too. Weights: (kd * kh * ceil(kw * C / 4), n_pad, 4) int8, four consecutive (kernel column,
 * channel) inputs of one output channel together, zero beyond each kernel row and beyond C_out; n_pad a multiple of
 * 16. */
typedef struct {
    const int8_t *w;
    const int32_t *colsum;
    const int32_t *ibias; /* qnnpack: the bias rounded to int32 steps of s_x * s_w, added to the sums; else 0 */
    const float *bias;  /* fbgemm: bias / (s_x * s_w), per output channel, as fbgemm divides it; else 0 */
    const float *mult;  /* s_x * s_w / s_out (qnnpack: s_w * s_x * (1 / s_out)) */
    int64_t cp, n_pad, cout, kernel[3], stride[3];
    int zx, zo, relu, qmax;
} ConvArgs;

__attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m128i conv_requantize(
    const ConvArgs *p, const __m512i acc, const int64_t col) {
    /* one formula for both engines: fbgemm adds its bias in float (ibias 0), qnnpack in int32 (bias 0.0f, and
     * adding 0.0f to a float changes nothing) */
    const __m512i offset = _mm512_mullo_epi32(_mm512_set1_epi32(p->zx), _mm512_loadu_si512(p->colsum + col));
    const __m512i sums = _mm512_add_epi32(_mm512_sub_epi32(acc, offset), _mm512_loadu_si512(p->ibias + col));
    const __m512 f = _mm512_add_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(p->bias + col));
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(f, _mm512_loadu_ps(p->mult + col)));
    const __m512i sum = _mm512_add_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(p->zo));
    const __m512i low = _mm512_set1_epi32(p->relu ? p->zo : 0);
    return _mm512_cvtusepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(sum, low), _mm512_set1_epi32(p->qmax)));
}

/* The input (N, D, H, W, C) at strides xs into a dense (N, D + 2 pd, H + 2 ph, W + 2 pw, C), the zero point around
 * it. */
static void conv_pad(const uint8_t *x, const int64_t *dims, const int64_t *xs, const int64_t *pads, int64_t cp,
                     int zx, uint8_t *pad) {
    const int64_t c = dims[4], dp = dims[1] + 2 * pads[0], hp = dims[2] + 2 * pads[1], wp = dims[3] + 2 * pads[2];
    const int64_t row = wp * cp;
    for (int64_t n = 0; n < dims[0]; n++)
        for (int64_t z = 0; z < dp; z++)
            for (int64_t i = 0; i < hp; i++) {
                uint8_t *dst = pad + ((n * dp + z) * hp + i) * row;
                const int64_t zz = z - pads[0], y = i - pads[1];
                if (zz < 0 || zz >= dims[1] || y < 0 || y >= dims[2]) {
                    memset(dst, zx, (size_t)row);
                    continue;
                }
                memset(dst, zx, (size_t)(pads[2] * cp));
                memset(dst + (pads[2] + dims[3]) * cp, zx, (size_t)(pads[2] * cp));
                const uint8_t *src = x + n * xs[0] + zz * xs[1] + y * xs[2];
                uint8_t *mid = dst + pads[2] * cp;
                if (xs[3] == c)
                    memcpy(mid, src, (size_t)(dims[3] * c));
                else
                    for (int64_t j = 0; j < dims[3]; j++)
                        memcpy(mid + j * cp, src + j * xs[3], (size_t)c);
            }
}

__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8"))) static void conv_amx(
    const ConvArgs *p, const uint8_t *pad, const int64_t *pdims /* N, Dp, Hp, Wp */,
    const int64_t *odims /* Do, Ho, Wo */, uint8_t *out, const int64_t *os /* n, d, h, w */) {
    /* one kernel row's inputs for one output position, rounded up to whole groups of four: the bytes beyond it (the
     * next position's) meet zero weights */
    const int64_t span = (p->kernel[2] * p->cp + 3) / 4 * 4;
    int64_t chunk = 4;
    for (int64_t c = 64; c >= 4; c -= 4)
        if (span % c == 0) {
            chunk = c;
            break;
        }
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 4; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    for (int t = 4; t < 6; t++) {
        config.rows[t] = 16;
        config.colsb[t] = (uint16_t)chunk;
    }
    for (int t = 6; t < 8; t++) {
        config.rows[t] = (uint8_t)(chunk / 4);
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    int32_t sums[4][16][16];
    const int64_t wo = odims[2], per_row = (wo + 15) / 16, lines = pdims[0] * odims[0] * odims[1];
    const int64_t blocks = lines * per_row, rows_per_plane = p->kernel[1], rows = p->kernel[0] * p->kernel[1];
    const int64_t w_stride = p->n_pad * 4, a_stride = p->stride[2] * p->cp, prow = pdims[3] * p->cp;
    const int64_t pplane = pdims[2] * prow;
    const __mmask16 tail_mask = (__mmask16)((1u << (p->cout % 16)) - 1);
    for (int64_t b = 0; b < blocks; b += 2) {
        const int two_rows = b + 1 < blocks;
        int64_t ow[2];
        uint8_t *dst[2];
        const uint8_t *a[2];
        for (int r = 0; r < 1 + two_rows; r++) {
            const int64_t line = (b + r) / per_row, oh = line % odims[1], od = line / odims[1] % odims[0];
            const int64_t n = line / (odims[0] * odims[1]);
            ow[r] = (b + r) % per_row * 16;
            a[r] = pad + (((n * pdims[1] + od * p->stride[0]) * pdims[2] + oh * p->stride[1]) * pdims[3] +
                          ow[r] * p->stride[2]) * p->cp;
            dst[r] = out + n * os[0] + od * os[1] + oh * os[2] + ow[r] * os[3];
        }
        for (int64_t col0 = 0; col0 < p->n_pad; col0 += 32) {
            const int two_cols = col0 + 32 <= p->n_pad;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < rows; k++) {  /* kernel rows: (depth, height) pairs */
                const int64_t shift = k / rows_per_plane * pplane + k % rows_per_plane * prow;
                for (int64_t k0 = 0; k0 < span; k0 += chunk) {
                    const int8_t *wk = p->w + ((k * span + k0) / 4) * w_stride + col0 * 4;
                    _tile_loadd(4, a[0] + shift + k0, a_stride);
                    _tile_loadd(6, wk, w_stride);
                    _tile_dpbusd(0, 4, 6);
                    if (two_rows) {
                        _tile_loadd(5, a[1] + shift + k0, a_stride);
                        _tile_dpbusd(1, 5, 6);
                    }
                    if (two_cols) {
                        _tile_loadd(7, wk + 64, w_stride);
                        _tile_dpbusd(2, 4, 7);
                        if (two_rows)
                            _tile_dpbusd(3, 5, 7);
                    }
                }
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
            for (int t = 0; t < 4; t++) {
                const int r = t % 2;
                const int64_t col = col0 + 16 * (t / 2);
                if ((r && !two_rows) || col >= p->cout)
                    continue;
                const int64_t valid = wo - ow[r] < 16 ? wo - ow[r] : 16;
                for (int64_t i = 0; i < valid; i++) {
                    const __m128i bytes = conv_requantize(p, _mm512_loadu_si512(sums[t][i]), col);
                    if (col + 16 <= p->cout)
                        _mm_storeu_si128((__m128i *)(dst[r] + i * os[3] + col), bytes);
                    else
                        _mm_mask_storeu_epi8(dst[r] + i * os[3] + col, tail_mask, bytes);
                }
            }
        }
    }
    _tile_release();
}

/* A Linear on a few rows (fewer than a 16-row tile fills) with AVX512-VNNI: up to 6 rows x 64 output channels of
 * int32 sums in registers, four inputs per vpdpbusd, the weights streamed once per 6 rows; the same requantization
 * as the tiles. x: rows of C bytes at stride xs; out: rows of C_out bytes at stride os. Weights blocked by 64
 * output channels: (ceil(n_pad / 64), ceil(C / 4), 64, 4) int8, so one block's bytes are read in order, where the
 * tiles' layout puts consecutive groups of four inputs n_pad * 4 bytes apart (docs/amx.md). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline)) static inline void rows_tile(
    const ConvArgs *p, const uint8_t *x, int64_t xs, uint8_t *out, int64_t os, const int rows, const int blocks,
    const int64_t col0) {
    const uint8_t *src[PATCH_ROWS];
    for (int r = 0; r < rows; r++)
        src[r] = x + r * xs;
    const int64_t k4 = (p->cp + 3) / 4;
    __m512i acc[PATCH_ROWS][PATCH_BLOCKS];
    vnni_sums(acc, src, rows, blocks, p->w + (col0 / 64) * k4 * 256, 256, p->cp);  /* blocked: one block streams */
    const __mmask16 tail_mask = (__mmask16)((1u << (p->cout % 16)) - 1);
    for (int c = 0; c < blocks; c++) {
        const int64_t col = col0 + 16 * c;
        if (col >= p->cout)
            break;
        for (int r = 0; r < rows; r++) {
            const __m128i bytes = conv_requantize(p, acc[r][c], col);
            if (col + 16 <= p->cout)
                _mm_storeu_si128((__m128i *)(out + r * os + col), bytes);
            else
                _mm_mask_storeu_epi8(out + r * os + col, tail_mask, bytes);
        }
    }
}

#define ROWS_CASE(R, B) case (R) * 8 + (B): rows_tile(p, x + row0 * xs, xs, out + row0 * os, os, R, B, col0); break;
#define ROWS_CASES(R) ROWS_CASE(R, 1) ROWS_CASE(R, 2) ROWS_CASE(R, 3) ROWS_CASE(R, 4)

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void rows_vnni(
    const ConvArgs *p, const uint8_t *x, int64_t rows, int64_t xs, uint8_t *out, int64_t os) {
    for (int64_t row0 = 0; row0 < rows; row0 += 6) {
        const int r_count = rows - row0 < 6 ? (int)(rows - row0) : 6;
        for (int64_t col0 = 0; col0 < p->n_pad; col0 += 64) {
            const int64_t left = (p->n_pad - col0) / 16;
            const int blocks = left < 4 ? (int)left : 4;
            switch (r_count * 8 + blocks) {
                ROWS_CASES(1) ROWS_CASES(2) ROWS_CASES(3) ROWS_CASES(4) ROWS_CASES(5) ROWS_CASES(6)
            }
        }
    }
}

int fxq_vnni_usable(void) {
    return fxq_isa_cap >= ISA_VNNI && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}

int fxq_amx_usable(void) { return amx_usable(); }
/* A Linear on rows of bytes with the conv loop's requantization and its weights blocked by 64 channels, by
 * AVX512-VNNI (few rows, where 16-row AMX tiles would be mostly empty). */
void fxq_linear_rows_u8(const ByteRows *x, int64_t rows, const GemmWeights *weights, const Requant *requant,
                        const ByteRows *out) {
    const ConvArgs p = {weights->w, weights->colsum, weights->ibias, weights->bias, weights->mult,
                        weights->in_channels, weights->n_pad, weights->out_channels, {1, 1, 1}, {1, 1, 1},
                        (int)requant->zx, (int)requant->zo, requant->relu, (int)requant->qmax};
    rows_vnni(&p, x->data, rows, x->stride, out->data, out->stride);
}

int fxq_conv_u8(const ConvInput *x, const ConvWindow *window, const GemmWeights *weights, const Requant *requant,
                const ConvOutput *out) {
    const int64_t *dims = x->dims, *pads = window->padding, *kernel = window->kernel, *stride = window->stride;
    const int64_t cp = weights->in_channels;
    const int64_t pdims[4] = {dims[0], dims[1] + 2 * pads[0], dims[2] + 2 * pads[1], dims[3] + 2 * pads[2]};
    const size_t used = (size_t)(pdims[0] * pdims[1] * pdims[2] * pdims[3] * cp);
    /* tiles of a row's last positions read up to 16 strides and a kernel row (rounded up) past it: slack after */
    const size_t size = used + (size_t)((16 * stride[2] + kernel[2]) * cp + 64);
    uint8_t *pad = malloc(size);
    if (pad == NULL)
        return -1;
    const ConvArgs p = {weights->w, weights->colsum, weights->ibias, weights->bias, weights->mult, cp, weights->n_pad,
                        weights->out_channels, {kernel[0], kernel[1], kernel[2]}, {stride[0], stride[1], stride[2]},
                        (int)requant->zx, (int)requant->zo, requant->relu, (int)requant->qmax};
    conv_pad(x->data, dims, x->strides, pads, cp, (int)requant->zx, pad);
    memset(pad + used, (int)requant->zx, size - used);
    conv_amx(&p, pad, pdims, out->size, out->data, out->strides);
    free(pad);
    return 0;
}

#else /* no x86-64 GNU C: no VNNI or AMX loops; module.c asks first and never calls the kernels */

int fxq_vnni_usable(void) { return 0; }

int fxq_amx_usable(void) { return 0; }

void fxq_linear_rows_u8(const ByteRows *x, int64_t rows, const GemmWeights *weights, const Requant *requant,
                        const ByteRows *out) {
    (void)x; (void)rows; (void)weights; (void)requant; (void)out;
}

int fxq_conv_u8(const ConvInput *x, const ConvWindow *window, const GemmWeights *weights, const Requant *requant,
                const ConvOutput *out) {
    (void)x; (void)window; (void)weights; (void)requant; (void)out;
    return 0;
}

#endif
