/* int8_rows_f32: a dynamic per-token INT8 Linear on a few rows (an LLM's decode step), on AVX512-VNNI.
 *
 * out[m, n] = float(sum_k q[m, k] * w[n, k]) * row_scale[m] * col_scale[n] (+ bias[n]): the int8 rows (quantized
 * per row by quantize_rows_s8) and the dense int8 weights are read as they lie, where torch._int_mm repacks the
 * weights on every call, which costs more than the sums on a decode step. vpdpbusd multiplies unsigned by signed
 * bytes, so each row is offset to unsigned (q + 128, a flip of the sign bit) and 128 * sum_k w[n, k] (weight_sums)
 * comes off the exact int32 sum: the same sums as torch._int_mm, then rescaled in the order fxq_rescale_rows rounds
 * them, so the bytes equal the _int_mm path's. Eight weight rows per step, each read once per pair of input rows.
 * Arguments arrive checked (module.c); runs without the GIL, only where fxq_vnni_usable().
 */
#include <stdint.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define ROW_BLOCK 2
#define COL_BLOCK 8

__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void block_vnni(
    const Int8Rows *p, const int64_t m0, const int rows, const int64_t n0) {
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
        __m512i x[ROW_BLOCK];
        for (int r = 0; r < rows; r++) /* masked-off bytes become 128 and meet zero weights */
            x[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, p->q + (m0 + r) * K + k), offset);
        for (int c = 0; c < COL_BLOCK; c++) {
            _mm_prefetch((const char *)(w[c] + COL_BLOCK * K + k), _MM_HINT_T0);
            const __m512i wc = _mm512_maskz_loadu_epi8(mask, w[c] + k);
            for (int r = 0; r < rows; r++)
                acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], x[r], wc);
        }
    }
    for (int c = 0; c < COL_BLOCK && n0 + c < N; c++)
        for (int r = 0; r < rows; r++) {
            const int32_t sum = _mm512_reduce_add_epi32(acc[r][c]) - 128 * p->weight_sums[n0 + c];
            float v = (float)sum * p->row_scale[m0 + r] * p->col_scale[n0 + c];
            if (p->bias)
                v = v + p->bias[n0 + c];
            p->out[(m0 + r) * N + n0 + c] = v;
        }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void fxq_int8_rows_f32(const Int8Rows *p) {
    for (int64_t m0 = 0; m0 < p->rows; m0 += ROW_BLOCK) {
        const int rows = p->rows - m0 < ROW_BLOCK ? (int)(p->rows - m0) : ROW_BLOCK;
        for (int64_t n0 = 0; n0 < p->out_features; n0 += COL_BLOCK) {
            if (rows == 1)
                block_vnni(p, m0, 1, n0);
            else
                block_vnni(p, m0, ROW_BLOCK, n0);
        }
    }
}
#else
void fxq_int8_rows_f32(const Int8Rows *p) { (void)p; } /* never called: fxq_vnni_usable() is 0 here */
#endif
