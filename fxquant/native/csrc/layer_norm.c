/* add_layer_norm_f32: y = LayerNorm(a + b) over rows of float32, in one pass over each row: a transformer's
 * residual add and the LayerNorm after it (BERT's post-LN blocks: LayerNorm(x + dense(x))).
 *
 * torch runs the two as two ops, each reading and writing whole tensors: at BERT-style sizes (1024 rows of 256) the
 * sum's 1 MB goes out of L2 and comes back. Here a row's sum stays in L1 between the row's three passes: the sum
 * (kept in y), the mean of the centered squares, the normalization in place.
 *
 * Arithmetic: s = a + b rounds as torch's add; mean = sum(s) / n and var = sum((s - mean)^2) / n (biased, as
 * LayerNorm's), each sum in LANES fixed lanes (lane i % LANES gets element i of the whole blocks of LANES, in index
 * order; the values past them in one sum of their own) reduced in a fixed tree, so every clone (VECTOR_CLONES:
 * AVX-512, AVX2, SSE2) and every thread count gives the same bits; rstd = 1 / sqrt(var + eps); y = (s * rstd +
 * (-rstd * mean)) * gamma + beta, torch's CPU kernel's formula. torch's moments come from a Welford recurrence in
 * its own lane order, so the two differ by float32 rounding (tests/kernels/test_layer_norm_kernel.py compares both
 * with a float64 reference). Rows are split over torch's threads, each row one thread's arithmetic. Arguments arrive
 * checked (module_rows.c); runs without the GIL.
 */
#include <math.h>
#include <stdint.h>

#include "native.h"

#define LANES 32 /* two AVX-512 vectors: two independent chains of additions (5-10% faster than one) */

/* The LANES partial sums added pairwise, halves first: one fixed order. */
static inline float lane_total(float acc[LANES]) {
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++)
            acc[l] += acc[l + width];
    return acc[0];
}

/* y = a + b over n values; returns their mean. */
VECTOR_CLONES static float sum_into(const float *restrict a, const float *restrict b, float *restrict y, int64_t n) {
    float acc[LANES] = {0}, tail = 0.0f;
    const int64_t body = n - n % LANES;
    for (int64_t i = 0; i < body; i += LANES)
        for (int l = 0; l < LANES; l++) {
            y[i + l] = a[i + l] + b[i + l];
            acc[l] += y[i + l];
        }
    for (int64_t i = body; i < n; i++) {
        y[i] = a[i] + b[i];
        tail += y[i];
    }
    return (lane_total(acc) + tail) / (float)n;
}

/* The mean of (y - mean)^2 over n values. */
VECTOR_CLONES static float centered_squares(const float *restrict y, int64_t n, float mean) {
    float acc[LANES] = {0}, tail = 0.0f;
    const int64_t body = n - n % LANES;
    for (int64_t i = 0; i < body; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float d = y[i + l] - mean;
            acc[l] += d * d;
        }
    for (int64_t i = body; i < n; i++) {
        const float d = y[i] - mean;
        tail += d * d;
    }
    return (lane_total(acc) + tail) / (float)n;
}

/* y = (y * scale + shift) * gamma + beta in place; gamma NULL: 1, beta NULL: 0. */
VECTOR_CLONES static void normalize(float *y, int64_t n, float scale, float shift, const float *gamma,
                                    const float *beta) {
    if (gamma && beta)
        for (int64_t i = 0; i < n; i++)
            y[i] = (y[i] * scale + shift) * gamma[i] + beta[i];
    else if (gamma)
        for (int64_t i = 0; i < n; i++)
            y[i] = (y[i] * scale + shift) * gamma[i];
    else
        for (int64_t i = 0; i < n; i++)
            y[i] = y[i] * scale + shift;
}

void fxq_add_layer_norm_f32(const AddLayerNorm *p) {
    const int64_t rows = p->rows, n = p->width;
    FXQ_PARALLEL_FOR(rows * n >= FXQ_PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) {
        float *y = p->y + r * n;
        const float mean = sum_into(p->a + r * n, p->b + r % p->b_rows * n, y, n);
        const float rstd = 1.0f / sqrtf(centered_squares(y, n, mean) + p->eps);
        normalize(y, n, rstd, -rstd * mean, p->gamma, p->beta);
    }
}
