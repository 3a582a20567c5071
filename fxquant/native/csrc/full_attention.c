/* full_attention_f32: softmax(q k^T * scale + mask) v in float32 on AVX-512 over every key: an encoder's
 * self-attention (BERT, ViT, Whisper's encoder) or a decoder's cross-attention, where every query sees every key.
 *
 * A work item is a head and a block of ROWS query rows. Its scores against all keys fit in a buffer of the item
 * (ROWS x keys floats, in L1/L2 at encoder lengths), so the softmax is exact in two passes, with no running rescale
 * as in attention.c's one-pass causal loop, whose blocks stop at the diagonal. Both products run one register tile
 * of RT rows x up to 4 vectors of 16 lanes, each operand read once per tile step: scores = q (broadcast, times scale
 * * log2(e)) x keys transposed (dim, keys; in blocks of 16 x 16, into a buffer of the thread, once per head the
 * thread's items reach, the row pitch padded off a power of two so the columns do not share cache sets); output =
 * probabilities (broadcast) x values, read in place, times 1 / sum. Scores are taken in base 2 (a probability is
 * one exp2). torch's flash kernel, which SDPA runs, walks blocks of keys with running rescales (docs/benchmarks.md,
 * "Attention over every key", compares the two).
 * Sums run with fused multiply-adds in 16 lanes, so they round differently from torch's kernels: the tests compare
 * both with a float64 reference. Items are split over torch's threads, each writing its own rows: the result does
 * not depend on the thread count. Arguments arrive checked (module_rows.c); runs without the GIL, only where
 * fxq_attention_usable().
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "exp2.h"

#define ROWS 32 /* query rows of one work item */
#define RT 4    /* rows of a register tile: RT x 4 accumulators of 16 lanes */
#define LOG2E 1.44269504089f

/* out[r][16 v + lane] = scale[r] * sum_t a[r][t] b[t][16 v + lane] for t < depth, RT (or fewer) rows of a (row
 * pitch a_pitch, broadcast), nv vectors of b (row pitch b_pitch): both products, scores = q x keys transposed (no
 * scale) and output = probabilities x values (times 1 / sum). */
__attribute__((target("avx512f"), always_inline)) static inline void tile(
    const float *a, const int64_t a_pitch, const float *b, const int64_t b_pitch, const int64_t depth, float *out,
    const int64_t out_pitch, const float *scale, const int rows, const int nv) {
    __m512 acc[RT][4];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++)
            acc[r][v] = _mm512_setzero_ps();
    for (int64_t t = 0; t < depth; t++) {
        __m512 bt[4];
        for (int v = 0; v < nv; v++)
            bt[v] = _mm512_loadu_ps(b + t * b_pitch + 16 * v);
        for (int r = 0; r < rows; r++) {
            const __m512 ar = _mm512_set1_ps(a[r * a_pitch + t]);
            for (int v = 0; v < nv; v++)
                acc[r][v] = _mm512_fmadd_ps(ar, bt[v], acc[r][v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++)
            _mm512_storeu_ps(out + r * out_pitch + 16 * v,
                             scale ? _mm512_mul_ps(acc[r][v], _mm512_set1_ps(scale[r])) : acc[r][v]);
}

/* The tiles of `rows` rows x `extent` lanes (a multiple of 16), each with constant sizes (so the accumulators
 * stay in registers): RT rows or the 1-3 left, 4 vectors or the 1-3 left. */
#define WIDTHS(call, rr, nv)                                                                                           \
    switch (nv) {                                                                                                      \
    case 4: call(rr, 4); break;                                                                                        \
    case 3: call(rr, 3); break;                                                                                        \
    case 2: call(rr, 2); break;                                                                                        \
    default: call(rr, 1);                                                                                              \
    }
#define TILES(call, rows, extent)                                                                                      \
    for (int r = 0; r < (rows); r += RT)                                                                               \
        for (int64_t at = 0; at < (extent); at += 64) {                                                                \
            const int nv_ = (extent) - at < 64 ? (int)(((extent) - at) / 16) : 4;                                     \
            switch ((rows) - r < RT ? (rows) - r : RT) {                                                               \
            case RT: WIDTHS(call, RT, nv_) break;                                                                      \
            case 3: WIDTHS(call, 3, nv_) break;                                                                        \
            case 2: WIDTHS(call, 2, nv_) break;                                                                        \
            default: WIDTHS(call, 1, nv_)                                                                              \
            }                                                                                                          \
        }

/* Row r's scores (base 2, masked) into probabilities, unnormalized; returns 1 / their sum (0: every key masked). */
__attribute__((target("avx512f"), always_inline)) static inline float softmax_row(
    float *s, const FullAttention *p, const int64_t b, const int64_t h, const int64_t row) {
    const int64_t keys = p->kv_tokens;
    const __mmask16 tail = keys % 16 ? (__mmask16)((1u << (keys % 16)) - 1) : (__mmask16)0xFFFF;
    const int64_t at = b * p->mask_strides[0] + h * p->mask_strides[1] + row * p->mask_strides[2];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys; j += 16) {
        const __mmask16 in = j + 16 > keys ? tail : (__mmask16)0xFFFF;
        __m512 x = _mm512_loadu_ps(s + j);
        if (p->mask_kind == FXQ_MASK_ADD) { /* a finite mask stays finite in base 2 (finfo.min x log2(e) would
                                               * overflow), so a row masked by it alone averages, as torch's does */
            const __m512 add = _mm512_maskz_loadu_ps(in, (const float *)p->mask + at + j);
            const __mmask16 finite = _mm512_cmp_ps_mask(add, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            x = _mm512_fmadd_ps(add, _mm512_set1_ps(LOG2E), x);
            x = _mm512_mask_max_ps(x, finite, x, _mm512_set1_ps(-FLT_MAX));
        } else if (p->mask_kind == FXQ_MASK_KEEP) {
            const uint8_t *bytes = (const uint8_t *)p->mask + at + j;
            uint8_t last[16] = {0}; /* the last block's bytes, read no further than the row */
            if (in != 0xFFFF)
                memcpy(last, bytes, (size_t)(keys - j));
            const __m128i kept = _mm_loadu_si128((const __m128i *)(in == 0xFFFF ? bytes : last));
            const __mmask16 keep = _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(kept), _mm512_set1_epi32(0xFF));
            x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, x);
        }
        _mm512_storeu_ps(s + j, x);
        top = _mm512_mask_max_ps(top, in, top, x);
    }
    const float m = _mm512_reduce_max_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
        const __m512 x = _mm512_loadu_ps(s + j);
        /* keys past the last, and masked-out ones (exp2 would give 2^-126, not 0), are exactly 0 */
        const __mmask16 in = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) &
                             (j + 16 > keys ? tail : (__mmask16)0xFFFF);
        const __m512 e = _mm512_maskz_mov_ps(in, exp2_ps(_mm512_sub_ps(x, _mm512_set1_ps(m))));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(s + j, e);
    }
    return m == -INFINITY ? 0.0f : 1.0f / _mm512_reduce_add_ps(sum);
}

/* dst[c * pitch + r] = src[r * stride + c] for a block of 16 x 16 floats, rows from `valid` on zero: two rounds of
 * in-lane unpacks and shuffles, then two of 128-bit lane shuffles (16 loads, 64 shuffles, 16 stores, where copying
 * element by element costs a load and a store each). */
__attribute__((target("avx512f"), always_inline)) static inline void transpose_block(
    const float *src, const int64_t stride, const int64_t valid, float *dst, const int64_t pitch) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = i < valid ? _mm512_loadu_ps(src + i * stride) : _mm512_setzero_ps();
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        _mm512_storeu_ps(dst + j * pitch, _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88));
        _mm512_storeu_ps(dst + (j + 8) * pitch, _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD));
    }
}

/* Item (b, h, rows r0 .. r0 + rows): the scores into `scores`, the softmax, the output rows. */
__attribute__((target("avx512f"))) static void item(const FullAttention *p, const float *kt, const int64_t pitch,
                                                     const int64_t keys_pad, float *qs, float *scores,
                                                     const int64_t b, const int64_t h, const int64_t r0,
                                                     const int rows) {
    const int64_t dim = p->dim, kvh = h / (p->heads / p->kv_heads);
    const float *q = p->q + b * p->q_strides[0] + h * p->q_strides[1] + r0 * p->q_strides[2];
    const __m512 to_base2 = _mm512_set1_ps(p->scale * LOG2E);
    for (int r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(qs + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(q + r * p->q_strides[2] + d), to_base2));
#define SCORES(rr, nv) tile(qs + r * dim, dim, kt + at, pitch, dim, scores + r * keys_pad + at, keys_pad, NULL, rr, nv)
    TILES(SCORES, rows, keys_pad)
    float inv[ROWS];
    for (int r = 0; r < rows; r++)
        inv[r] = softmax_row(scores + r * keys_pad, p, b, h, r0 + r);
    const float *v = p->v + b * p->v_strides[0] + kvh * p->v_strides[1];
    float *out = p->out + b * p->out_strides[0] + h * p->out_strides[1] + r0 * p->out_strides[2];
#define VALUES(rr, nv)                                                                                              \
    tile(scores + r * keys_pad, keys_pad, v + at, p->v_strides[2], p->kv_tokens, out + r * p->out_strides[2] + at,   \
         p->out_strides[2], inv + r, rr, nv)
    TILES(VALUES, rows, dim)
}

/* kt (dim, keys_pad at pitch) = the keys of (batch, kv head) `kv` transposed, zero past the last token. */
__attribute__((target("avx512f"))) static void transpose_keys(const FullAttention *p, const int64_t kv, float *kt,
                                                               const int64_t pitch, const int64_t keys_pad) {
    const float *k = p->k + kv / p->kv_heads * p->k_strides[0] + kv % p->kv_heads * p->k_strides[1];
    for (int64_t t = 0; t < keys_pad; t += 16)
        for (int64_t d = 0; d < p->dim; d += 16)
            transpose_block(k + t * p->k_strides[2] + d, p->k_strides[2], p->kv_tokens - t, kt + d * pitch + t, pitch);
}

/* Items in order (batch, head, block of rows), split in contiguous runs over torch's threads; each thread transposes
 * the keys of the items it takes into a buffer of its own when their (batch, kv head) changes, so a head's keys are
 * transposed once per thread that runs its items and are read back from L1/L2, not from a buffer of all heads. */
__attribute__((target("avx512f"))) static void attention_avx512(const FullAttention *p, float *scratch,
                                                                 int64_t *held, const int64_t pitch,
                                                                 const int64_t keys_pad, const int64_t per_thread) {
    const int64_t blocks = (p->q_tokens + ROWS - 1) / ROWS, items = p->batch * p->heads * blocks;
    const int64_t work = p->batch * p->heads * p->q_tokens * p->kv_tokens * p->dim;
    (void)work; /* read only by the OpenMP pragma */
    FXQ_PARALLEL_FOR(work >= FXQ_PARALLEL_WORK)
    for (int64_t i = 0; i < items; i++) {
        const int64_t b = i / (p->heads * blocks), h = i / blocks % p->heads, r0 = i % blocks * ROWS;
        const int64_t kv = b * p->kv_heads + h / (p->heads / p->kv_heads), thread = FXQ_THREAD();
        float *kt = scratch + thread * per_thread, *qs = kt + p->dim * pitch;
        if (held[thread] != kv) {
            transpose_keys(p, kv, kt, pitch, keys_pad);
            held[thread] = kv;
        }
        const int rows = p->q_tokens - r0 < ROWS ? (int)(p->q_tokens - r0) : ROWS;
        item(p, kt, pitch, keys_pad, qs, qs + ROWS * p->dim, b, h, r0, rows);
    }
}

int fxq_full_attention_f32(const FullAttention *p) {
    const int64_t keys_pad = (p->kv_tokens + 15) / 16 * 16, pitch = keys_pad + 16, threads = FXQ_THREADS();
    const int64_t per_thread = p->dim * pitch + ROWS * (p->dim + keys_pad); /* transposed keys, q rows, scores */
    float *scratch = (float *)malloc((size_t)(threads * per_thread) * sizeof(float));
    int64_t *held = (int64_t *)malloc((size_t)threads * sizeof(int64_t)); /* whose keys each thread's buffer has */
    const int status = scratch == NULL || held == NULL ? -1 : 0;
    if (status == 0) {
        for (int64_t t = 0; t < threads; t++)
            held[t] = -1;
        attention_avx512(p, scratch, held, pitch, keys_pad, per_thread);
    }
    free(scratch);
    free(held);
    return status;
}

#else /* no x86-64 GNU C: module_rows.c asks fxq_attention_usable() first and never calls the kernel */

int fxq_full_attention_f32(const FullAttention *p) {
    (void)p;
    return 0;
}

#endif
