/* conv3x3_onednn: a 3x3 conv of stride 1 as Winograd F(2x2, 3x3) (Lavin and Gray, 2015) in exact integers on AVX2,
 * for the onednn backend's convs on CPUs with AVX2 alone, where every int8 kernel is bound by its multiplies: the
 * 36 multiply-adds of a 2x2 output tile's direct sums become 16, and the int16 products (vpmaddwd) run at the rate
 * of the int8 pair sums (vpmaddubsw + vpmaddwd) oneDNN's kernel uses, so a 3x3 layer takes 0.57-0.78 of its time
 * on an AMD EPYC Zen 1 (docs/backends.md, "3x3 convs as Winograd F(2x2, 3x3)").
 *
 * Exact, not approximate: the input's 4x4 tiles are transformed with B^T d B on (x - zx), whose entries are sums of
 * four inputs (|v| <= 4 * 255, int16), the weights with (2G) g (2G)^T, whose entries are integers (|u| <= 9 * 128),
 * and the output with A^T m A, which is then 4x the direct sum: an arithmetic shift by 2 gives the same int32 sum
 * as oneDNN's (int32 arithmetic wraps, so only the result must fit: 4 * 9 * c * 255 * 128 < 2^31 for c <= 1827).
 * oneDNN's requantization follows (onednn_requant.h), so the bytes are the primitive's
 * (tests/kernels/test_onednn_winograd.py). Padding reads as the zero point (a real 0), as oneDNN pads.
 *
 * Work: blocks of up to TILES tiles (and, where those are fewer than four per thread, ranges of their outputs)
 * split over torch's threads (each output is one thread's, computed in one order: the bytes do not depend on the
 * thread count). Per block, the transformed inputs (16 points x tiles x c16 int16)
 * stay in L2; per 16 outputs, the 16 points' products (6 tiles x 16 outputs in 12 accumulators) go to a small
 * buffer the output transform reads. Arguments arrive checked (module.c); runs without the GIL. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_convs.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "onednn_requant.h"

#define TILES 24 /* tiles per block, a multiple of ROWS */
#define ROWS 6   /* tiles per register block */
#define OUTS 16  /* outputs per register block: two ymm of eight */

typedef struct {
    int64_t tiles_h, tiles_w, out_h, out_w;
} Tiling;

/* the tile's (image, top-left output row, column) */
static inline void tile_at(const Tiling *t, int64_t tile, int64_t *image, int64_t *row, int64_t *col) {
    const int64_t per_image = t->tiles_h * t->tiles_w, within = tile % per_image;
    *image = tile / per_image;
    *row = 2 * (within / t->tiles_w);
    *col = 2 * (within % t->tiles_w);
}

/* v[p][tile][c] = (B^T d B)[p] of the tile's 4x4 inputs d (centered: x - zx; 0 outside the image), 16 channels at a
 * time; channels past c read 0 - zx, which meet zero weights. */
__attribute__((target("avx2"))) static void transform_inputs(const WinoInput *x, const Tiling *t, int64_t first,
                                                             int64_t count, int64_t c16, int16_t *v) {
    const __m256i zx = _mm256_set1_epi16((short)x->zx);
    for (int64_t i = 0; i < count; i++) {
        int64_t image, row, col;
        tile_at(t, first + i, &image, &row, &col);
        const int64_t y0 = row - x->pad_h, x0 = col - x->pad_w;
        for (int64_t c0 = 0; c0 < c16; c0 += 16) {
            __m256i d[4][4], s[4][4];
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++) {
                    const int64_t y = y0 + a, xx = x0 + b;
                    if (y < 0 || y >= x->h || xx < 0 || xx >= x->w) {
                        d[a][b] = _mm256_setzero_si256();
                        continue;
                    }
                    const uint8_t *p = x->data + ((image * x->h + y) * x->w + xx) * x->c + c0;
                    __m128i bytes;
                    if (c0 + 16 <= x->c) {
                        bytes = _mm_loadu_si128((const __m128i *)p);
                    } else {
                        uint8_t tail[16] = {0};
                        memcpy(tail, p, (size_t)(x->c - c0));
                        bytes = _mm_loadu_si128((const __m128i *)tail);
                    }
                    d[a][b] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(bytes), zx);
                }
            for (int b = 0; b < 4; b++) { /* B^T d: rows d0 - d2, d1 + d2, d2 - d1, d1 - d3 */
                s[0][b] = _mm256_sub_epi16(d[0][b], d[2][b]);
                s[1][b] = _mm256_add_epi16(d[1][b], d[2][b]);
                s[2][b] = _mm256_sub_epi16(d[2][b], d[1][b]);
                s[3][b] = _mm256_sub_epi16(d[1][b], d[3][b]);
            }
            for (int a = 0; a < 4; a++) { /* (B^T d) B: the same on columns */
                const __m256i o[4] = {_mm256_sub_epi16(s[a][0], s[a][2]), _mm256_add_epi16(s[a][1], s[a][2]),
                                      _mm256_sub_epi16(s[a][2], s[a][1]), _mm256_sub_epi16(s[a][1], s[a][3])};
                for (int b = 0; b < 4; b++)
                    _mm256_storeu_si256((__m256i *)(v + ((4 * a + b) * TILES + i) * c16 + c0), o[b]);
            }
        }
    }
}

/* m[r][0..15] = sum over c of v[r][c] * u[c][0..15] for ROWS tiles r (v rows c16 apart), int16 pairs by vpmaddwd */
__attribute__((target("avx2"))) static inline void point_products(const int16_t *v, int64_t c16, const int16_t *u,
                                                                  int32_t *m) {
    __m256i acc[ROWS][2];
    for (int r = 0; r < ROWS; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t pair = 0; pair < c16 / 2; pair++) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(u + 32 * pair));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(u + 32 * pair + 16));
        for (int r = 0; r < ROWS; r++) {
            int32_t two;
            memcpy(&two, v + r * c16 + 2 * pair, sizeof(two));
            const __m256i a = _mm256_set1_epi32(two);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, b0));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, b1));
        }
    }
    for (int r = 0; r < ROWS; r++) {
        _mm256_storeu_si256((__m256i *)(m + OUTS * r), acc[r][0]);
        _mm256_storeu_si256((__m256i *)(m + OUTS * r + 8), acc[r][1]);
    }
}

/* The outputs k0 .. k0 + 15 of one tile from its 16 points' products m[p][16] (points TILES * OUTS apart): A^T m A,
 * a shift by 2, then oneDNN's requantization of each of the tile's outputs inside the image */
__attribute__((target("avx2"))) static void tile_outputs(const WinoWeights *w, const OnednnRequant *r,
                                                         const OnednnSum *sum, const Tiling *t, int64_t tile,
                                                         const int32_t *m, int64_t k0, uint8_t *out) {
    int64_t image, row, col;
    tile_at(t, tile, &image, &row, &col);
    for (int64_t half = 0; half < 2 && k0 + 8 * half < w->out_channels; half++) {
        const int64_t k = k0 + 8 * half, n = w->out_channels - k;
        __m256i p[16], q[2][4];
        for (int i = 0; i < 16; i++)
            p[i] = _mm256_loadu_si256((const __m256i *)(m + i * TILES * OUTS + 8 * half));
        for (int b = 0; b < 4; b++) { /* A^T m: rows m0 + m1 + m2, m1 - m2 - m3 */
            q[0][b] = _mm256_add_epi32(_mm256_add_epi32(p[b], p[4 + b]), p[8 + b]);
            q[1][b] = _mm256_sub_epi32(_mm256_sub_epi32(p[4 + b], p[8 + b]), p[12 + b]);
        }
        for (int a = 0; a < 2 && row + a < t->out_h; a++) {
            const __m256i y[2] = {
                _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(q[a][0], q[a][1]), q[a][2]), 2),
                _mm256_srai_epi32(_mm256_sub_epi32(_mm256_sub_epi32(q[a][1], q[a][2]), q[a][3]), 2)};
            for (int b = 0; b < 2 && col + b < t->out_w; b++) {
                uint8_t *dst = out + ((image * t->out_h + row + a) * t->out_w + col + b) * w->out_channels + k;
                fxq_onednn_store8(y[b], w->mult + k, w->bias + k, r, sum, dst, n);
            }
        }
    }
}

/* One work item: a block of tiles, its inputs transformed, then per 16 outputs of chunks [first_chunk, end_chunk)
 * the 16 points' products and the output transform */
__attribute__((target("avx2"))) static void item(const WinoInput *x, const WinoWeights *w, const OnednnRequant *r,
                                                 const OnednnSum *sum, const Tiling *t, int64_t first, int64_t count,
                                                 int64_t first_chunk, int64_t end_chunk, int16_t *v, int32_t *m,
                                                 uint8_t *out) {
    transform_inputs(x, t, first, count, w->c16, v);
    for (int64_t chunk = first_chunk; chunk < end_chunk; chunk++) {
        for (int point = 0; point < 16; point++) {
            const int16_t *u = w->u + ((int64_t)point * (w->k16 / OUTS) + chunk) * w->c16 * OUTS;
            for (int64_t i = 0; i < count; i += ROWS)
                point_products(v + (point * TILES + i) * w->c16, w->c16, u, m + (point * TILES + i) * OUTS);
        }
        for (int64_t i = 0; i < count; i++)
            tile_outputs(w, r, sum, t, first + i, m + i * OUTS, chunk * OUTS, out);
    }
}

__attribute__((target("avx2"))) int fxq_conv3x3_winograd_avx2(const WinoInput *x, const WinoWeights *w,
                                                               const OnednnRequant *r, const OnednnSum *sum,
                                                               uint8_t *out, int64_t out_h, int64_t out_w) {
    const Tiling t = {(out_h + 1) / 2, (out_w + 1) / 2, out_h, out_w};
    const int64_t tiles = x->n * t.tiles_h * t.tiles_w, chunks = w->k16 / OUTS;
    /* blocks of equal size (a multiple of ROWS, at most TILES); where they are too few to keep every thread busy,
     * each block's outputs split too, so that each thread gets about four items (their inputs are transformed once
     * per item: a few percent of the work) */
    const int64_t blocks = (tiles + TILES - 1) / TILES, size = ((tiles + blocks - 1) / blocks + ROWS - 1) / ROWS * ROWS;
    const int64_t threads = FXQ_THREADS(), wanted = (4 * threads + blocks - 1) / blocks;
    const int64_t splits = threads == 1 ? 1 : wanted < chunks ? wanted : chunks, items = blocks * splits;
    /* the scratch is zeroed once: the register blocks past a block's last tile read it and their products are
     * never stored */
    const size_t v_size = sizeof(int16_t) * 16 * TILES * (size_t)w->c16, m_size = sizeof(int32_t) * 16 * TILES * OUTS;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel if (items > 1 && tiles * w->c16 * w->k16 >= FXQ_PARALLEL_WORK) reduction(| : failed)
#endif
    {
        int16_t *v = calloc(1, v_size);
        int32_t *m = calloc(1, m_size);
        failed = v == NULL || m == NULL;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < items; i++) {
            const int64_t b = i / splits, s = i % splits, first = b * size;
            if (!failed)
                item(x, w, r, sum, &t, first, tiles - first < size ? tiles - first : size, s * chunks / splits,
                     (s + 1) * chunks / splits, v, m, out);
        }
        free(v);
        free(m);
    }
    return failed ? -1 : 0;
}

#else /* no x86-64 GNU C: module.c asks fxq_avx2_usable first and never calls the kernel */

int fxq_conv3x3_winograd_avx2(const WinoInput *x, const WinoWeights *w, const OnednnRequant *r, const OnednnSum *sum,
                              uint8_t *out, int64_t out_h, int64_t out_w) {
    (void)x; (void)w; (void)r; (void)sum; (void)out; (void)out_h; (void)out_w;
    return -1;
}

#endif
