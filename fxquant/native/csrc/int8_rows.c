/* int8_rows_f32: a dynamic per-token INT8 Linear on a few float32 rows (an LLM's decode step), on AVX512-VNNI,
 * in one call: the whole of fxquant.kernels.per_token.per_token_linear for float32 rows.
 *
 * Each row, times SmoothQuant's input_scale where there is one, is quantized per row as quantize_rows_s8 does it
 * (elementwise.c), into a buffer of this call; then out[m, n] = float(sum_k q[m, k] * w[n, k]) * row_scale[m] *
 * col_scale[n] (+ bias[n]). The int8 rows and the dense int8 weights are read as they lie, where torch._int_mm
 * repacks the weights on every call, which costs more than the sums on a decode step, and one call replaces the
 * half-dozen torch ops and Python steps around them, which cost as much again. vpdpbusd multiplies unsigned by
 * signed bytes, so each row is offset to unsigned (q + 128, a flip of the sign bit) and 128 * sum_k w[n, k]
 * (weight_sums) comes off the exact int32 sum: the same sums as torch._int_mm, then rescaled in the order
 * fxq_rescale_rows rounds them, so the bytes equal the torch path's. Eight weight rows per step, each read from
 * memory once; the steps are split over torch's threads (FXQ_PARALLEL_FOR). Arguments arrive checked
 * (module_rows.c); runs without the GIL, only where fxq_vnni_usable().
 */
#include <stdint.h>
#include <stdlib.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "gemm.h"

#define ROW_BLOCK 2
#define COL_BLOCK 8

/* The quantized rows of one call. */
typedef struct {
    const int8_t *q;
    const float *scale;
} QuantizedRows;

__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void block_vnni(
    const Int8Rows *p, const QuantizedRows *x, const int64_t m0, const int rows, const int64_t n0) {
    const int64_t K = p->in_features, N = p->out_features;
    const int8_t *w[COL_BLOCK];
    for (int c = 0; c < COL_BLOCK; c++) /* past the last output: the last row again (computed, not stored) */
        w[c] = p->w + (n0 + c < N ? n0 + c : N - 1) * K;
    __m512i acc[ROW_BLOCK][COL_BLOCK];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < COL_BLOCK; c++)
            acc[r][c] = _mm512_setzero_si512();
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += 64) {
        const __mmask64 mask = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512i a[ROW_BLOCK];
        for (int r = 0; r < rows; r++) /* masked-off bytes become 128 and meet zero weights */
            a[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, x->q + (m0 + r) * K + k), offset);
        for (int c = 0; c < COL_BLOCK; c++) {
            _mm_prefetch((const char *)(w[c] + COL_BLOCK * K + k), _MM_HINT_T0);
            const __m512i wc = _mm512_maskz_loadu_epi8(mask, w[c] + k);
            for (int r = 0; r < rows; r++)
                acc[r][c] = fxq_dpbusd(acc[r][c], a[r], wc);
        }
    }
    for (int c = 0; c < COL_BLOCK && n0 + c < N; c++)
        for (int r = 0; r < rows; r++) {
            const int32_t sum = _mm512_reduce_add_epi32(acc[r][c]) - 128 * p->weight_sums[n0 + c];
            float v = (float)sum * x->scale[m0 + r] * p->col_scale[n0 + c];
            if (p->bias)
                v = v + p->bias[n0 + c];
            p->out[(m0 + r) * N + n0 + c] = v;
        }
}

/* Every row against the outputs of each block of COL_BLOCK, the blocks split over torch's threads: a block's
 * weights are read from memory once and stay in L1 for the next pair of rows. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void rows_vnni(const Int8Rows *p,
                                                                          const QuantizedRows *x) {
    const int64_t blocks = (p->out_features + COL_BLOCK - 1) / COL_BLOCK;
    FXQ_PARALLEL_FOR(p->out_features * p->in_features >= FXQ_PARALLEL_WORK)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m0 = 0; m0 < p->rows; m0 += ROW_BLOCK) {
            if (p->rows - m0 == 1)
                block_vnni(p, x, m0, 1, b * COL_BLOCK);
            else
                block_vnni(p, x, m0, ROW_BLOCK, b * COL_BLOCK);
        }
}
#endif

int fxq_int8_rows_f32(const Int8Rows *p) {
#if defined(__x86_64__) && defined(__GNUC__)
    int8_t *q = (int8_t *)malloc((size_t)(p->rows * p->in_features) + 1);
    float *scale = (float *)malloc((size_t)p->rows * sizeof(float) + 1);
    if (q == NULL || scale == NULL) {
        free(q);
        free(scale);
        return -1;
    }
    fxq_quantize_rows_s8(p->x, p->rows, p->in_features, p->x_stride, p->input_scale, q, scale);
    const QuantizedRows x = {q, scale};
    rows_vnni(p, &x);
    free(q);
    free(scale);
#else
    (void)p; /* never called: fxq_vnni_usable() is 0 here */
#endif
    return 0;
}
