/* scan_f32: the histogram observers' counting (see fxquant/observers/counting.py for the contract).
 *
 * It reads a batch of float32 values once: per block of values that fits in L1, a min/max/NaN pass, then (while
 * every value seen lies on the grid) the bin indices and their counts. torch has no fused op for this; its pieces
 * (aminmax, a scale-and-shift, a conversion, bincount) each re-read the batch. Counts go to eight interleaved
 * sub-histograms: after a ReLU half the values fall in one bin, and incrementing one counter in a row waits on the
 * previous store each time.
 *
 * The bin of x is floor(x * scale) - start / width, as the torch path computes it, exactly (see block_count).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define BLOCK 2048
#define WAYS 8
#define FLUSH_EVERY (1LL << 30) /* values per flush of the uint32 sub-histograms into the int64 counts */

/* min, max and whether a NaN is present, over x[0..n): four independent vector accumulators where SSE2 is there
 * (a single running min waits on the previous comparison for every value). */
VECTOR_CLONES static void block_range(const float *x, int64_t n, float *lo, float *hi, int *nan) {
    float mn = *lo, mx = *hi;
    int bad = 0;
    int64_t i = 0;
#ifdef __SSE2__
    __m128 vmin[4], vmax[4], vnan = _mm_setzero_ps();
    for (int k = 0; k < 4; k++) {
        vmin[k] = _mm_set1_ps(mn);
        vmax[k] = _mm_set1_ps(mx);
    }
    for (; i + 16 <= n; i += 16) {
        for (int k = 0; k < 4; k++) {
            __m128 v = _mm_loadu_ps(x + i + 4 * k);
            vmin[k] = _mm_min_ps(vmin[k], v);
            vmax[k] = _mm_max_ps(vmax[k], v);
            vnan = _mm_or_ps(vnan, _mm_cmpunord_ps(v, v));
        }
    }
    float lanes[4];
    __m128 m = _mm_min_ps(_mm_min_ps(vmin[0], vmin[1]), _mm_min_ps(vmin[2], vmin[3]));
    _mm_storeu_ps(lanes, m);
    for (int k = 0; k < 4; k++) mn = lanes[k] < mn ? lanes[k] : mn;
    m = _mm_max_ps(_mm_max_ps(vmax[0], vmax[1]), _mm_max_ps(vmax[2], vmax[3]));
    _mm_storeu_ps(lanes, m);
    for (int k = 0; k < 4; k++) mx = lanes[k] > mx ? lanes[k] : mx;
    bad = _mm_movemask_ps(vnan) != 0;
#endif
    for (; i < n; i++) {
        float v = x[i];
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        bad |= v != v;
    }
    *lo = mn;
    *hi = mx;
    *nan |= bad;
}

/* The bin of x is floor(x * scale) - first: the product is exact (scale is a power of two) and so is the
 * integer subtraction, so a value's bin never depends on where the grid starts (merged counts stay exact). */
VECTOR_CLONES static void block_count(const float *x, int64_t n, float scale, int32_t first, int32_t *index, uint32_t *sub,
                        int64_t stride) {
    for (int64_t i = 0; i < n; i++) {
        const float y = x[i] * scale;
        const int32_t t = (int32_t)y;            /* toward zero ... */
        index[i] = t - (y < (float)t) - first;  /* ... then down: floor */
    }
    int64_t i = 0;
    for (; i + WAYS <= n; i += WAYS)
        for (int w = 0; w < WAYS; w++) sub[w * stride + index[i + w]]++;
    for (; i < n; i++) sub[index[i]]++;
}

/* Adds the sub-histograms into the int64 totals (one slot per bin plus the top edge) and clears them. */
static void flush(uint32_t *sub, int64_t slots, int64_t *totals) {
    for (int w = 0; w < WAYS; w++)
        for (int64_t b = 0; b < slots; b++) totals[b] += sub[w * slots + b];
    memset(sub, 0, sizeof(uint32_t) * WAYS * (size_t)slots);
}

int fxq_scan_f32(const float *x, int64_t n, const HistogramGrid *grid, double *out, ScanResult *result) {
    const double start = grid->start, top = grid->top;
    const int64_t bins = grid->bins, slots = bins + 1;
    const float fstart = (float)start, ftop = (float)top;
    uint32_t *sub = calloc((size_t)WAYS * (size_t)slots, sizeof(uint32_t));
    int64_t *totals = calloc((size_t)slots, sizeof(int64_t));
    if (sub == NULL || totals == NULL) {
        free(sub);
        free(totals);
        return -1;
    }
    const double width = (top - start) / (double)bins; /* a power of two: its inverse is exact */
    const float scale = (float)(1.0 / width);
    const int32_t first = (int32_t)(start / width); /* an integer below 2**22 in magnitude (grid_for) */
    float lo = INFINITY, hi = -INFINITY;
    int nan = 0, on_grid = 1;
    int32_t index[BLOCK];
    int64_t since_flush = 0;
    for (int64_t begin = 0; begin < n; begin += BLOCK) {
        int64_t len = n - begin < BLOCK ? n - begin : BLOCK;
        float blo = INFINITY, bhi = -INFINITY;
        block_range(x + begin, len, &blo, &bhi, &nan);
        lo = blo < lo ? blo : lo;
        hi = bhi > hi ? bhi : hi;
        if (!on_grid) continue;
        if (nan || blo < fstart || bhi > ftop) {
            on_grid = 0;
            continue;
        }
#if defined(__GNUC__)
        /* the next block is read from memory while this one is counted from L1 */
        for (int64_t k = begin + BLOCK; k < begin + 2 * BLOCK && k < n; k += 16) __builtin_prefetch(x + k);
#endif
        block_count(x + begin, len, scale, first, index, sub, slots);
        since_flush += len;
        if (since_flush >= FLUSH_EVERY) {
            flush(sub, slots, totals);
            since_flush = 0;
        }
    }
    if (on_grid) {
        flush(sub, slots, totals);
        for (int64_t b = 0; b < bins; b++) out[b] = (double)totals[b];
        out[bins - 1] += (double)totals[bins];
    }
    free(sub);
    free(totals);
    if (nan) lo = hi = NAN;
    result->lo = lo;
    result->hi = hi;
    result->on_grid = on_grid;
    return 0;
}
