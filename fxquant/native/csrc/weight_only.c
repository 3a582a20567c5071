/* weight_only_f32: a Linear on a few float32 rows with int8 weights (W8A16, "weight-only"), for LLM decoding.
 *
 * out[m, n] = sum_k x[m, k] * (float(w[n, k]) * scale[n, k / group]) + bias[n], one scale per group of inputs of
 * each output (group = in_features: one per output channel): the weights stay int8 in memory and are widened
 * to float32 in registers, so a decode step (one row per sequence) reads a quarter of the bytes a float32 Linear
 * reads, which is what bounds it. Eight weight rows at a time, each read from memory once for all the rows, the
 * blocks of eight split over torch's threads (FXQ_PARALLEL_FOR);
 * the sums run in float32 with fused multiply-adds in 16 lanes (AVX-512) or 8 (AVX2), so they round differently from
 * torch's float32 GEMM (tests compare both with a float64 reference). SmoothQuant's input_scale, where there is
 * one, multiplies each row first, as torch's mul would. Arguments arrive checked (module_rows.c); the loop runs
 * without the GIL. Where it is used: fxquant/kernels/weight_only.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "native.h"

#define ROW_BLOCK 2 /* input rows per pass over the weights */
#define COL_BLOCK 8 /* weight rows (outputs) per step: 8 independent sums per input row hide the FMA latency */

static void finish(const WeightOnlyRows *p, const int64_t m, const int64_t n, const float sum) {
    p->out[m * p->out_stride + n] = sum + (p->bias ? p->bias[n] : 0.0f);
}

/* The scale of weight (n, k). */
static inline float scale_at(const WeightOnlyRows *p, const int64_t n, const int64_t k) {
    return p->scale[n * (p->in_features / p->group) + k / p->group];
}

/* Any x86-64 (or other) CPU: the same sums, one lane, for every row and the outputs of the block at n0. */
static void block_scalar(const WeightOnlyRows *p, const int64_t n0) {
    for (int64_t n = n0; n < n0 + COL_BLOCK && n < p->out_features; n++) {
        const int8_t *w = p->w + n * p->in_features;
        for (int64_t m = 0; m < p->rows; m++) {
            const float *x = p->x + m * p->x_stride;
            float sum = 0.0f;
            for (int64_t k = 0; k < p->in_features; k++)
                sum += x[k] * ((float)w[k] * scale_at(p, n, k));
            finish(p, m, n, sum);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* The weight rows and scale rows of the block at n0; past the last output, the last row again (computed, not
 * stored), so the loops below have constant bounds and their sums stay in registers. */
static inline void block_rows(const WeightOnlyRows *p, const int64_t n0, const int8_t *w[COL_BLOCK],
                              const float *s[COL_BLOCK]) {
    for (int c = 0; c < COL_BLOCK; c++) {
        const int64_t n = n0 + c < p->out_features ? n0 + c : p->out_features - 1;
        w[c] = p->w + n * p->in_features;
        s[c] = p->scale + n * (p->in_features / p->group);
    }
}

/* rows (1 or 2, a constant once inlined) input rows at m0 against the COL_BLOCK outputs at n0. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline void block_avx512(
    const WeightOnlyRows *p, const int64_t m0, const int rows, const int64_t n0) {
    const int64_t K = p->in_features;
    const int8_t *w[COL_BLOCK];
    const float *s[COL_BLOCK];
    block_rows(p, n0, w, s);
    __m512 acc[ROW_BLOCK][COL_BLOCK];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < COL_BLOCK; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1u);
        const int64_t g = k / p->group; /* the 16 inputs lie in one group: a group is a multiple of 16, or K */
        __m512 x[ROW_BLOCK];
        for (int r = 0; r < rows; r++)
            x[r] = _mm512_maskz_loadu_ps(mask, p->x + (m0 + r) * p->x_stride + k);
        if (k % 64 == 0) /* the next block's weights: 8 rows read 16 bytes at a time outrun the prefetcher */
            for (int c = 0; c < COL_BLOCK; c++)
                _mm_prefetch((const char *)(w[c] + COL_BLOCK * K + k), _MM_HINT_T0);
        for (int c = 0; c < COL_BLOCK; c++) {
            const __m512 wc = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w[c] + k))), _mm512_set1_ps(s[c][g]));
            for (int r = 0; r < rows; r++)
                acc[r][c] = _mm512_fmadd_ps(x[r], wc, acc[r][c]);
        }
    }
    for (int c = 0; c < COL_BLOCK && n0 + c < p->out_features; c++)
        for (int r = 0; r < rows; r++)
            finish(p, m0 + r, n0 + c, _mm512_reduce_add_ps(acc[r][c]));
}

/* Every row against the outputs of the block at n0: its weights come from memory once, then from L1. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void rows_avx512(const WeightOnlyRows *p,
                                                                           const int64_t n0) {
    for (int64_t m0 = 0; m0 < p->rows; m0 += ROW_BLOCK) {
        if (p->rows - m0 == 1)
            block_avx512(p, m0, 1, n0);
        else
            block_avx512(p, m0, ROW_BLOCK, n0);
    }
}

__attribute__((target("avx2,fma"))) static inline float sum8(const __m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

__attribute__((target("avx2,fma"), always_inline)) static inline void block_avx2(
    const WeightOnlyRows *p, const int64_t m0, const int rows, const int64_t n0) {
    const int64_t K = p->in_features, full = K - K % 8;
    const int8_t *w[COL_BLOCK];
    const float *s[COL_BLOCK];
    block_rows(p, n0, w, s);
    __m256 acc[ROW_BLOCK][COL_BLOCK];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < COL_BLOCK; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < full; k += 8) {
        const int64_t g = k / p->group; /* the 8 inputs lie in one group (a multiple of 16, or K) */
        __m256 x[ROW_BLOCK];
        for (int r = 0; r < rows; r++)
            x[r] = _mm256_loadu_ps(p->x + (m0 + r) * p->x_stride + k);
        if (k % 64 == 0)
            for (int c = 0; c < COL_BLOCK; c++)
                _mm_prefetch((const char *)(w[c] + COL_BLOCK * K + k), _MM_HINT_T0);
        for (int c = 0; c < COL_BLOCK; c++) {
            const __m256 wc = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w[c] + k)))),
                _mm256_set1_ps(s[c][g]));
            for (int r = 0; r < rows; r++)
                acc[r][c] = _mm256_fmadd_ps(x[r], wc, acc[r][c]);
        }
    }
    for (int c = 0; c < COL_BLOCK && n0 + c < p->out_features; c++)
        for (int r = 0; r < rows; r++) {
            const float *x = p->x + (m0 + r) * p->x_stride;
            float sum = sum8(acc[r][c]);
            for (int64_t k = full; k < K; k++)
                sum += x[k] * ((float)w[c][k] * s[c][k / p->group]);
            finish(p, m0 + r, n0 + c, sum);
        }
}

__attribute__((target("avx2,fma"))) static void rows_avx2(const WeightOnlyRows *p, const int64_t n0) {
    for (int64_t m0 = 0; m0 < p->rows; m0 += ROW_BLOCK) {
        if (p->rows - m0 == 1)
            block_avx2(p, m0, 1, n0);
        else
            block_avx2(p, m0, ROW_BLOCK, n0);
    }
}
#endif

/* The loop over the blocks of outputs of the widest path this CPU and the ISA cap allow. */
typedef void (*BlockLoop)(const WeightOnlyRows *p, int64_t n0);

static BlockLoop widest_path(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (fxq_isa_cap >= ISA_AVX512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        return rows_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return rows_avx2;
#endif
    return block_scalar;
}

int fxq_weight_only_f32(const WeightOnlyRows *p) {
    WeightOnlyRows scaled = *p;
    float *x = NULL;
    if (p->input_scale) { /* x * input_scale once, rounded as torch's mul rounds it, then the loop on those rows */
        x = (float *)malloc((size_t)(p->rows * p->in_features) * sizeof(float) + 1);
        if (x == NULL)
            return -1;
        for (int64_t m = 0; m < p->rows; m++)
            for (int64_t k = 0; k < p->in_features; k++)
                x[m * p->in_features + k] = p->x[m * p->x_stride + k] * p->input_scale[k];
        scaled.x = x;
        scaled.x_stride = p->in_features;
    }
    const BlockLoop loop = widest_path();
    const int64_t blocks = (p->out_features + COL_BLOCK - 1) / COL_BLOCK;
    FXQ_PARALLEL_FOR(p->out_features * p->in_features >= FXQ_PARALLEL_WORK)
    for (int64_t b = 0; b < blocks; b++)
        loop(&scaled, b * COL_BLOCK);
    free(x);
    return 0;
}
