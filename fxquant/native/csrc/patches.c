/* patches_u8: a transposed conv whose kernel equals its stride (U-Net upsampling) as fbgemm's quantized Linear
 * computes it, with each input position's output patch written straight to its place in the (N, OH, OW, C) output.
 * fbgemm's own Linear needs a depth-to-space copy after it (docs/amx.md); fbgemm's direct transposed kernel gives
 * wrong results (fbgemm_transposed.py).
 *
 * Bit-identical to quantized::linear on fbgemm with a VNNI CPU (tests/kernels/test_patches_native.py): exact int32
 * sums of u8*s8 products (vpdpbusd), minus the input zero point times each column's weight sum, then fbgemm's
 * float-bias requantization: fma(bias, 1 / (s_x * s_w), float(acc)) * multiplier, rounded to nearest even,
 * saturated to int16, plus the output zero point, saturated to [0, 255]. Weights per tensor with zero point 0.
 * The weight comes packed as (ceil(K / 4), n_pad, 4) int8: four consecutive inputs of one output column together,
 * zero beyond K and beyond the real columns; n_pad is a multiple of 16.
 *
 * Arguments arrive checked (module.c), which also asks fxq_vnni_usable / fxq_amx_usable first; the kernel runs
 * without the GIL. Where it is used, and what it gains: docs/amx.md. */
#include <stdint.h>
#include <string.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "gemm.h"

typedef struct {
    const int8_t *w;
    const int32_t *colsum;
    const float *bias;
    int64_t k, n_pad, cout, direct;
    float rcp, mult;
    int zx, zo;
    const int64_t *patch_offsets;
} PatchArgs;

/* Sixteen int32 sums of columns col..col+15 to output bytes, as fbgemm's requantization rounds them. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m128i patch_requantize(
    const PatchArgs *p, const __m512i acc, const int64_t col) {
    const __m512i offset = _mm512_mullo_epi32(_mm512_set1_epi32(p->zx), _mm512_loadu_si512(p->colsum + col));
    const __m512 f = _mm512_fmadd_ps(_mm512_loadu_ps(p->bias + col), _mm512_set1_ps(p->rcp),
                                     _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, offset)));
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(f, _mm512_set1_ps(p->mult)));
    /* fbgemm saturates to int16, adds the zero point, saturates to uint8; below -32768 the sum is negative either
     * way (and cannot wrap: q >= INT32_MIN, zo >= 0), so only the upper bound needs its own step */
    const __m512i sum = _mm512_add_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(p->zo));
    return _mm512_cvtusepi32_epi8(_mm512_max_epi32(sum, _mm512_setzero_si512()));
}

/* The output patch of input row (n, h, w), then the next row's position (counted on: a division per row costs more
 * than the row's products). */
static inline uint8_t *patch_row(uint8_t *out, const int64_t *os, const int64_t *patch, const int64_t *dims,
                                 int64_t *n, int64_t *h, int64_t *w) {
    uint8_t *dst = out + *n * os[0] + *h * patch[0] * os[1] + *w * patch[1] * os[2];
    if (++*w == dims[2]) {
        *w = 0;
        if (++*h == dims[1]) {
            *h = 0;
            ++*n;
        }
    }
    return dst;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void patch_tile(
    const PatchArgs *p, const uint8_t *const *src, uint8_t *const *dst, uint8_t (*line)[2048], const int rows,
    const int blocks, const int64_t col0) {
    __m512i acc[PATCH_ROWS][PATCH_BLOCKS];
    vnni_sums(acc, src, rows, blocks, p->w + col0 * 4, p->n_pad * 4, p->k);
    for (int c = 0; c < blocks; c++) {
        const int64_t col = col0 + 16 * c;
        for (int r = 0; r < rows; r++) {
            const __m128i bytes = patch_requantize(p, acc[r][c], col);
            if (p->direct)  /* 16 columns inside one patch: straight to the output */
                _mm_storeu_si128((__m128i *)(dst[r] + p->patch_offsets[col / p->cout] + col % p->cout), bytes);
            else
                _mm_storeu_si128((__m128i *)(line[r] + col), bytes);
        }
    }
}

#define PATCH_CASE(R, B) case (R) * 8 + (B): patch_tile(p, src, dst, line, R, B, col0); break;
#define PATCH_CASES(R) PATCH_CASE(R, 1) PATCH_CASE(R, 2) PATCH_CASE(R, 3) PATCH_CASE(R, 4)

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void patches_vnni(
    const PatchArgs *p, const uint8_t *x, const int64_t *dims, const int64_t *xs, uint8_t *out, const int64_t *os,
    const int64_t *patch, const int64_t first) {
    static __thread uint8_t line[PATCH_ROWS][2048];
    const int64_t rows = dims[0] * dims[1] * dims[2], n_cols = patch[0] * patch[1] * p->cout;
    int64_t n = first / (dims[1] * dims[2]), h = first / dims[2] % dims[1], w = first % dims[2];
    for (int64_t row0 = first; row0 < rows; row0 += PATCH_ROWS) {
        const int r_count = rows - row0 < PATCH_ROWS ? (int)(rows - row0) : PATCH_ROWS;
        const uint8_t *src[PATCH_ROWS];
        uint8_t *dst[PATCH_ROWS];
        for (int r = 0; r < r_count; r++) {
            src[r] = x + n * xs[0] + h * xs[1] + w * xs[2];
            dst[r] = patch_row(out, os, patch, dims, &n, &h, &w);
        }
        for (int64_t col0 = 0; col0 < p->n_pad; col0 += 16 * PATCH_BLOCKS) {
            const int64_t left = (p->n_pad - col0) / 16;
            const int blocks = left < PATCH_BLOCKS ? (int)left : PATCH_BLOCKS;
            switch (r_count * 8 + blocks) {
                PATCH_CASES(1) PATCH_CASES(2) PATCH_CASES(3) PATCH_CASES(4) PATCH_CASES(5) PATCH_CASES(6)
            }
        }
        if (!p->direct)
            for (int r = 0; r < r_count; r++)
                for (int64_t col = 0; col < n_cols; col += p->cout)
                    memcpy(dst[r] + p->patch_offsets[col / p->cout], line[r] + col, (size_t)p->cout);
    }
}
/* With AMX-INT8 (Sapphire Rapids on), blocks of 32 rows x 32 columns are four 16x16 int32 tiles summed by
 * tdpbusd (exact, like vpdpbusd) from two 16-row input tiles and two weight tiles; the sums go through the same
 * requantization. Needs rows at one stride (a dense channels-last input), C_in a multiple of 4 and whole 16-column
 * output blocks (C_out a multiple of 16); the last rows (fewer than 32) take the VNNI loop. Linux grants the tile
 * state to a process on request (arch_prctl); where it does not, the VNNI loop does everything. */
__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8"))) static void patches_amx(
    const PatchArgs *p, const uint8_t *x, const int64_t row_stride, const int64_t rows, const int64_t *dims,
    uint8_t *out, const int64_t *os, const int64_t *patch) {
    int64_t chunk = 4;  /* the widest input chunk (<= 64 bytes, a multiple of 4) that divides C_in */
    for (int64_t c = 64; c >= 4; c -= 4)
        if (p->k % c == 0) {
            chunk = c;
            break;
        }
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 4; t++) {  /* sums */
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    for (int t = 4; t < 6; t++) {  /* inputs: 16 rows of one chunk */
        config.rows[t] = 16;
        config.colsb[t] = (uint16_t)chunk;
    }
    for (int t = 6; t < 8; t++) {  /* weights: chunk / 4 groups of four inputs x 16 columns */
        config.rows[t] = (uint8_t)(chunk / 4);
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    int32_t sums[4][16][16];
    const int64_t w_stride = p->n_pad * 4;
    int64_t n = 0, h = 0, w = 0;
    for (int64_t row0 = 0; row0 + 32 <= rows; row0 += 32) {
        uint8_t *dst[32];
        for (int r = 0; r < 32; r++)
            dst[r] = patch_row(out, os, patch, dims, &n, &h, &w);
        const uint8_t *a = x + row0 * row_stride;
        for (int64_t col0 = 0; col0 < p->n_pad; col0 += 32) {
            const int two = col0 + 32 <= p->n_pad;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k0 = 0; k0 < p->k; k0 += chunk) {
                const int8_t *b = p->w + (k0 / 4) * w_stride + col0 * 4;
                _tile_loadd(4, a + k0, row_stride);
                _tile_loadd(5, a + 16 * row_stride + k0, row_stride);
                _tile_loadd(6, b, w_stride);
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 5, 6);
                if (two) {
                    _tile_loadd(7, b + 64, w_stride);
                    _tile_dpbusd(2, 4, 7);
                    _tile_dpbusd(3, 5, 7);
                }
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            if (two) {
                _tile_stored(2, sums[2], 64);
                _tile_stored(3, sums[3], 64);
            }
            for (int t = 0; t < (two ? 4 : 2); t++) {
                const int64_t col = col0 + 16 * (t / 2);
                const int64_t offset = p->patch_offsets[col / p->cout] + col % p->cout;
                for (int r = 0; r < 16; r++)
                    _mm_storeu_si128((__m128i *)(dst[16 * (t % 2) + r] + offset),
                                     patch_requantize(p, _mm512_loadu_si512(sums[t][r]), col));
            }
        }
    }
    _tile_release();
}
/* Strides in bytes of the (N, H, W) dimensions, channels at stride 1 in both. AMX for the whole 32-row blocks where
 * the rows lie at one stride, VNNI for the rest. */
void fxq_patches_u8(const PatchInput *x, const PatchWeights *weights, const PatchRequant *requant,
                    const PatchOutput *out, const int64_t kernel[2], int amx) {
    const int64_t *dims = x->dims, *xs = x->strides, *os = out->strides, cout = weights->out_channels;
    const int64_t k = weights->in_channels;
    int64_t offsets[2048];
    for (int64_t a = 0; a < kernel[0]; a++)
        for (int64_t b = 0; b < kernel[1]; b++)
            offsets[a * kernel[1] + b] = a * os[1] + b * os[2];
    const PatchArgs p = {weights->w, weights->colsum, weights->bias, k, weights->n_pad, cout, cout % 16 == 0,
                         (float)requant->rcp, (float)requant->multiplier, (int)requant->zx, (int)requant->zo, offsets};
    const int64_t rows = dims[0] * dims[1] * dims[2];
    const int uniform = xs[1] == xs[2] * dims[2] && (dims[0] < 2 || xs[0] == xs[1] * dims[1]);
    const int64_t tiled = amx && uniform && p.direct && k % 4 == 0 ? rows / 32 * 32 : 0;
    if (tiled)
        patches_amx(&p, x->data, xs[2], tiled, dims, out->data, os, kernel);
    patches_vnni(&p, x->data, dims, xs, out->data, os, kernel, tiled);
}

#else /* no x86-64 GNU C: module.c asks fxq_vnni_usable first and never calls the kernel */

void fxq_patches_u8(const PatchInput *x, const PatchWeights *weights, const PatchRequant *requant,
                    const PatchOutput *out, const int64_t kernel[2], int amx) {
    (void)x; (void)weights; (void)requant; (void)out; (void)kernel; (void)amx;
}

#endif
