/* fxquant.native._native: five hot loops in C, each with a torch fallback that gives the same results.
 *
 * scan_f32: the histogram observers' counting (see fxquant/observers/counting.py for the contract).
 * quantize_f32: float32 -> uint8/int8 activations (fxquant/kernels/plain_int8.py), optionally NCHW -> NHWC.
 * mean_u8: the global average pool of uint8 activations (fxquant/kernels/plain_int8.py), in integers.
 * mul_u8: the product of two uint8 activations (an SE gate), rounded once (fxquant/kernels/plain_int8.py).
 * lookup_u8: a 256-entry table applied to every byte (an element-wise function of int8 values, fxquant/nn/lookup.py).
 *
 * scan_f32 reads a batch of float32 values once: per block of values that fits in L1, a min/max/NaN pass, then
 * (while every value seen lies on the grid) the bin indices and their counts. torch has no fused op for this; its
 * pieces (aminmax, a scale-and-shift, a conversion, bincount) each re-read the batch. Counts go to eight interleaved
 * sub-histograms: after a ReLU half the values fall in one bin, and incrementing one counter in a row waits on the
 * previous store each time (measured: 0.60 vs 0.84 ns per value with four on constant data, in cache).
 *
 * The bin of x is floor(x * scale) - start / width, as the torch path computes it, exactly (see block_count).
 * setup.py builds with -ffp-contract=off: no fused multiply-adds, so each operation rounds where torch's does. The
 * GIL is released in both loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The instruction sets the loops may use, capped by FXQUANT_ISA (fxquant.native.isa; set once by fxquant.native through
 * set_isa_cap): 0 AVX2, 1 AVX512, 2 AVX512-VNNI, 3 AMX. A loop runs where both the cap and the CPU allow it. */
enum { ISA_AVX2, ISA_AVX512, ISA_VNNI, ISA_AMX };
static int isa_cap = ISA_AMX;

static PyObject *set_isa_cap(PyObject *self, PyObject *args) {
    int level;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &level))
        return NULL;
    if (level < ISA_AVX2 || level > ISA_AMX) {
        PyErr_SetString(PyExc_ValueError, "set_isa_cap: level must be 0 (avx2) to 3 (amx)");
        return NULL;
    }
    isa_cap = level;
    Py_RETURN_NONE;
}
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* The hot loops get AVX2 and AVX-512 clones, one chosen at load for this CPU (the default clone runs anywhere): the
 * same operations, each rounded the same way (-ffp-contract=off), so results do not depend on the clone. Measured
 * with AVX-512: quantize 2.1-2.7x faster on contiguous tensors, counting ~15-20% faster. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

#define BLOCK 2048
#define WAYS 8
#define FLUSH_EVERY (1LL << 30) /* values per flush of the uint32 sub-histograms into the int64 counts */

/* min, max and whether a NaN is present, over x[0..n): four independent vector accumulators where SSE2 is there
 * (a single running min waits on the previous comparison for every value, ~4x slower). */
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

/* scan_f32(x_ptr, n, start, top, out_ptr, bins) -> (lo, hi, on_grid)
 *
 * x_ptr: n dense float32 values; the grid: bins bins of equal power-of-two width from start to top, both exact in
 * float32 (ValueError otherwise). When every value lies in [start, top], out_ptr's bins float64 slots are
 * overwritten with the per-bin counts (values equal to top in the last bin, as torch.histc) and on_grid is True;
 * otherwise (a value off the grid, or NaN) out is left alone and on_grid is False. lo/hi: the min and max of all n
 * values (NaN if any is NaN), read to the end either way because the caller needs the whole batch's range.
 */
static PyObject *scan_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr;
    long long n, bins;
    double start, top;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLddKL", &x_addr, &n, &start, &top, &out_addr, &bins)) return NULL;
    const float fstart = (float)start, ftop = (float)top;
    if (n < 0 || bins < 1 || !(top > start) || (double)fstart != start || (double)ftop != top) {
        PyErr_SetString(PyExc_ValueError, "scan_f32: needs n >= 0, bins >= 1 and a grid exact in float32");
        return NULL;
    }
    const float *x = (const float *)(uintptr_t)x_addr;
    double *out = (double *)(uintptr_t)out_addr;
    const int64_t slots = bins + 1;
    uint32_t *sub = calloc((size_t)WAYS * (size_t)slots, sizeof(uint32_t));
    int64_t *totals = calloc((size_t)slots, sizeof(int64_t));
    if (sub == NULL || totals == NULL) {
        free(sub);
        free(totals);
        return PyErr_NoMemory();
    }
    const double width = (top - start) / (double)bins; /* a power of two: its inverse is exact */
    const float scale = (float)(1.0 / width);
    const int32_t first = (int32_t)(start / width); /* an integer below 2**22 in magnitude (grid_for) */
    float lo = INFINITY, hi = -INFINITY;
    int nan = 0, on_grid = 1;
    int32_t index[BLOCK];
    Py_BEGIN_ALLOW_THREADS
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
        /* the next block is read from memory while this one is counted from L1: ~15% faster on cold activations */
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
    Py_END_ALLOW_THREADS
    free(sub);
    free(totals);
    if (nan) lo = hi = NAN;
    return Py_BuildValue("ddO", (double)lo, (double)hi, on_grid ? Py_True : Py_False);
}

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

/* The loops of quantize_f32 (below), outside the GIL. */
VECTOR_CLONES static void quantize_loop(const float *x, void *out, int64_t outer, int64_t channels, int64_t inner,
                                        float scale, float lo, float hi, int zp, int signed_out, int to_nhwc) {
    uint8_t *out_u8 = (uint8_t *)out;
    int8_t *out_s8 = (int8_t *)out;
    if (!to_nhwc) {
        const int64_t total = outer * channels * inner;
        if (signed_out)
            for (int64_t i = 0; i < total; i++) out_s8[i] = (int8_t)((int)quantized(x[i], scale, lo, hi) + zp);
        else
            for (int64_t i = 0; i < total; i++) out_u8[i] = (uint8_t)((int)quantized(x[i], scale, lo, hi) + zp);
        return;
    }
    float block[QUANT_BLOCK];
    for (int64_t n = 0; n < outer; n++) {
        for (int64_t begin = 0; begin < inner; begin += QUANT_BLOCK) {
            const int64_t len = inner - begin < QUANT_BLOCK ? inner - begin : QUANT_BLOCK;
            const int64_t base = (n * inner + begin) * channels;
            for (int64_t c = 0; c < channels; c++) {
                const float *src = x + (n * channels + c) * inner + begin;
                for (int64_t i = 0; i < len; i++) block[i] = quantized(src[i], scale, lo, hi);
                if (signed_out)
                    for (int64_t i = 0; i < len; i++) out_s8[base + i * channels + c] = (int8_t)((int)block[i] + zp);
                else
                    for (int64_t i = 0; i < len; i++) out_u8[base + i * channels + c] = (uint8_t)((int)block[i] + zp);
            }
        }
    }
}

/* quantize_f32(x_ptr, out_ptr, outer, channels, inner, scale, zero_point, qmin, qmax, signed_out, to_nhwc)
 *
 * x: outer * channels * inner dense float32 values in that order (NCHW: outer = N, inner = H * W); out: as many
 * uint8 (signed_out: int8) values, in the same order, or with to_nhwc in outer * inner * channels order (NHWC,
 * i.e. torch.channels_last memory). One read and one write per value; torch needs a pass per step and ~0.5 ns per
 * byte more for the NCHW -> NHWC copy of a 3-channel image.
 */
static PyObject *quantize_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr;
    long long outer, channels, inner, zero_point, qmin, qmax;
    double scale;
    int signed_out, to_nhwc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKLLLdLLLpp", &x_addr, &out_addr, &outer, &channels, &inner, &scale, &zero_point,
                          &qmin, &qmax, &signed_out, &to_nhwc))
        return NULL;
    if (outer < 0 || channels < 1 || inner < 0 || !(scale > 0) || qmin > qmax || qmin < -128 || qmax > 255) {
        PyErr_SetString(PyExc_ValueError, "quantize_f32: bad shape, scale or range");
        return NULL;
    }
    const float *x = (const float *)(uintptr_t)x_addr;
    void *out = (void *)(uintptr_t)out_addr;
    const float fscale = (float)scale, lo = (float)(qmin - zero_point), hi = (float)(qmax - zero_point);
    Py_BEGIN_ALLOW_THREADS
    quantize_loop(x, out, outer, channels, inner, fscale, lo, hi, (int)zero_point, signed_out, to_nhwc);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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

/* The loops of mean_u8 (below), outside the GIL. sums: channels counters. */
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

/* mean_u8(x_ptr, out_ptr, outer, channels, inner, s_outer, s_channel, s_inner, zero_point, qmin, qmax)
 *
 * x: uint8 values at x[n * s_outer + c * s_channel + i * s_inner] (strides in elements); out: outer * channels
 * dense uint8, out[n, c] = clamp(round_half_even(mean_i(x[n, c, i]) - zero_point) + zero_point, qmin, qmax): the
 * rounded mean of the centered integers, as fxquant's adaptive average pool defines it, computed exactly (a 32-bit
 * sum per channel, one division). torch needs a float copy, the pool and four passes of requantization.
 */
static PyObject *mean_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr;
    long long outer, channels, inner, s_outer, s_channel, s_inner, zero_point, qmin, qmax;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKLLLLLLLLL", &x_addr, &out_addr, &outer, &channels, &inner, &s_outer, &s_channel,
                          &s_inner, &zero_point, &qmin, &qmax))
        return NULL;
    if (outer < 0 || channels < 1 || inner < 1 || inner > (long long)(UINT32_MAX / 255) || qmin < 0 || qmax > 255 ||
        qmin > qmax || zero_point < qmin || zero_point > qmax) {
        PyErr_SetString(PyExc_ValueError, "mean_u8: bad shape or range");
        return NULL;
    }
    uint32_t *sums = (uint32_t *)malloc((size_t)channels * sizeof(uint32_t));
    if (sums == NULL) return PyErr_NoMemory();
    const uint8_t *x = (const uint8_t *)(uintptr_t)x_addr;
    uint8_t *out = (uint8_t *)(uintptr_t)out_addr;
    Py_BEGIN_ALLOW_THREADS
    mean_loop(x, out, sums, outer, channels, inner, s_outer, s_channel, s_inner, (int)zero_point, (int)qmin,
              (int)qmax);
    Py_END_ALLOW_THREADS
    free(sums);
    Py_RETURN_NONE;
}

/* The loops of mul_u8 (below), outside the GIL: float32 or float64 arithmetic, as PlainInt8Backend.mul does it.
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

/* mul_u8(a_ptr, b_ptr, out_ptr, (outer, channels, inner), a_strides, b_strides, out_strides, za, zb, zo, qmin, qmax,
 *        k, float64)
 *
 * Element [n, r, i] of each uint8 tensor lies at ptr[n * s[0] + r * s[1] + i * s[2]] (strides in elements; 0 where b
 * is broadcast, e.g. an SE gate of shape (N, C, 1, 1)); the caller puts the dimension with the smallest strides last
 * (channels for channels-last tensors). out = clamp(rint((a - za) * ((b - zb) * k)) + zo, qmin,
 * qmax), each product rounded in float32 (float64 if asked) in that order, k rounded to that type first: the
 * operations fxquant's torch path runs, so the results are the same bits, in one pass instead of seven.
 */
static PyObject *mul_u8(PyObject *self, PyObject *args) {
    unsigned long long a_addr, b_addr, out_addr;
    int64_t shape[3], sa[3], sb[3], so[3];
    long long za, zb, zo, qmin, qmax;
    double k;
    int wide;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKK(LLL)(LLL)(LLL)(LLL)LLLLLdp", &a_addr, &b_addr, &out_addr, &shape[0], &shape[1],
                          &shape[2], &sa[0], &sa[1], &sa[2], &sb[0], &sb[1], &sb[2], &so[0], &so[1], &so[2], &za, &zb,
                          &zo, &qmin, &qmax, &k, &wide))
        return NULL;
    if (shape[0] < 0 || shape[1] < 0 || shape[2] < 0 || qmin < 0 || qmax > 255 || qmin > qmax || zo < qmin ||
        zo > qmax || !(k == k)) {
        PyErr_SetString(PyExc_ValueError, "mul_u8: bad shape, range or factor");
        return NULL;
    }
    const uint8_t *a = (const uint8_t *)(uintptr_t)a_addr, *b = (const uint8_t *)(uintptr_t)b_addr;
    uint8_t *out = (uint8_t *)(uintptr_t)out_addr;
    Py_BEGIN_ALLOW_THREADS
    if (wide)
        mul_loop_f64(a, b, out, shape, sa, sb, so, (int)za, (int)zb, (int)zo, (int)qmin, (int)qmax, k);
    else
        mul_loop_f32(a, b, out, shape, sa, sb, so, (int)za, (int)zb, (int)zo, (int)qmin, (int)qmax, k);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* lookup_u8(src, dst, n, table): dst[i] = table[src[i]] over n bytes. With AVX512-VBMI, 64 bytes per step: two
 * 128-entry permutes (the index's low seven bits pick within each half of the table) and a blend on its top bit;
 * elsewhere one byte at a time (still one pass where dequantize -> function -> quantize takes three). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void lookup_vbmi(const uint8_t *src, uint8_t *dst,
                                                                              Py_ssize_t n, const uint8_t *table) {
    const __m512i t0 = _mm512_loadu_si512(table), t1 = _mm512_loadu_si512(table + 64),
                  t2 = _mm512_loadu_si512(table + 128), t3 = _mm512_loadu_si512(table + 192);
    Py_ssize_t i = 0;
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

static PyObject *lookup_u8(PyObject *self, PyObject *args) {
    unsigned long long src_addr, dst_addr, table_addr;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnK", &src_addr, &dst_addr, &n, &table_addr))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "lookup_u8: negative length");
        return NULL;
    }
    const uint8_t *src = (const uint8_t *)(uintptr_t)src_addr, *table = (const uint8_t *)(uintptr_t)table_addr;
    uint8_t *dst = (uint8_t *)(uintptr_t)dst_addr;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_VBMI_LOOKUP
    if (isa_cap >= ISA_AVX512 && __builtin_cpu_supports("avx512vbmi"))
        lookup_vbmi(src, dst, n, table);
    else
#endif
        for (Py_ssize_t i = 0; i < n; i++)
            dst[i] = table[src[i]];
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* patches_u8: a transposed conv whose kernel equals its stride (U-Net upsampling) as fbgemm's quantized Linear
 * computes it, with each input position's output patch written straight to its place in the (N, OH, OW, C) output.
 * fbgemm's own Linear needs a depth-to-space copy after it; with it, U-Net's upsamplers at batch 8 take 3-6x this
 * loop's time (docs/amx.md). fbgemm's direct transposed kernel is about as fast but wrong (fbgemm_transposed.py).
 *
 * Bit-identical to quantized::linear on fbgemm with a VNNI CPU (tests/kernels/test_patches_native.py): exact int32
 * sums of u8*s8 products (vpdpbusd), minus the input zero point times each column's weight sum, then fbgemm's
 * float-bias requantization: fma(bias, 1 / (s_x * s_w), float(acc)) * multiplier, rounded to nearest even,
 * saturated to int16, plus the output zero point, saturated to [0, 255]. Weights per tensor with zero point 0.
 * The weight comes packed as (ceil(K / 4), n_pad, 4) int8: four consecutive inputs of one output column together,
 * zero beyond K and beyond the real columns; n_pad is a multiple of 16. */
#if defined(__x86_64__) && defined(__GNUC__)
#define PATCH_ROWS 6
#define PATCH_BLOCKS 4

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

/* int32 sums of up to 6 rows x 4 blocks of 16 output channels, exact: four inputs per vpdpbusd, the weights of
 * inputs 4 kk .. 4 kk + 3 at w + kk * kstride (64 bytes per block); a row's last inputs (k not a multiple of 4) meet
 * zero weights. The upsampler and few-row Linear loops differ only in where the weights lie and what follows. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void vnni_sums(
    __m512i acc[PATCH_ROWS][PATCH_BLOCKS], const uint8_t *const *src, const int rows, const int blocks,
    const int8_t *w, const int64_t kstride, const int64_t k) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < blocks; c++)
            acc[r][c] = _mm512_setzero_si512();
    const int64_t full = k / 4, tail = k % 4;
    for (int64_t kk = 0; kk < full + (tail != 0); kk++) {
        const int8_t *wk = w + kk * kstride;
        __m512i b[PATCH_BLOCKS];
        for (int c = 0; c < blocks; c++)
            b[c] = _mm512_loadu_si512(wk + 64 * c);
        for (int r = 0; r < rows; r++) {
            int32_t four = 0;
            if (kk < full)
                memcpy(&four, src[r] + 4 * kk, 4);
            else
                for (int64_t j = 0; j < tail; j++)
                    four |= (int32_t)src[r][4 * kk + j] << (8 * j);
            const __m512i a = _mm512_set1_epi32(four);
            for (int c = 0; c < blocks; c++)
                acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], a, b[c]);
        }
    }
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
#define HAVE_VNNI_PATCHES 1

/* With AMX-INT8 (Sapphire Rapids on), blocks of 32 rows x 32 columns are four 16x16 int32 tiles summed by
 * tdpbusd (exact, like vpdpbusd) from two 16-row input tiles and two weight tiles; the sums go through the same
 * requantization. Needs rows at one stride (a dense channels-last input), C_in a multiple of 4 and whole 16-column
 * output blocks (C_out a multiple of 16); the last rows (fewer than 32) take the VNNI loop. Linux grants the tile
 * state to a process on request (arch_prctl); where it does not, the VNNI loop does everything. */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_usable(void) {
    static int usable = -1;
    if (isa_cap < ISA_AMX)
        return 0;
    if (usable < 0) {
        unsigned int a, b, c, d;
        usable = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25)) &&
                 syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return usable;
}

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
#define HAVE_AMX_PATCHES 1
#endif

/* patches_u8(x, (N, H, W), x strides, K, w, colsum, bias, n_pad, C_out, rcp, multiplier, zx, zo, out, out strides,
 * (kh, kw)): strides in bytes of the (N, H, W) dimensions, channels at stride 1 in both. Returns False (nothing
 * written) where the CPU has no AVX512-VNNI: the caller keeps fbgemm's Linear. */
static PyObject *patches_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, colsum_addr, bias_addr, out_addr;
    int64_t dims[3], xs[3], os[3], patch[2], k, n_pad, cout, zx, zo;
    double rcp, mult;
    (void)self;
    if (!PyArg_ParseTuple(args, "K(LLL)(LLL)LKKKLLddLLK(LLL)(LL)", &x_addr, &dims[0], &dims[1], &dims[2], &xs[0],
                          &xs[1], &xs[2], &k, &w_addr, &colsum_addr, &bias_addr, &n_pad, &cout, &rcp, &mult, &zx,
                          &zo, &out_addr, &os[0], &os[1], &os[2], &patch[0], &patch[1]))
        return NULL;
    const int64_t n_cols = patch[0] * patch[1] * cout;
    if (dims[0] < 0 || dims[1] < 0 || dims[2] < 0 || k < 1 || cout < 1 || patch[0] < 1 || patch[1] < 1 ||
        n_pad % 16 || n_pad < n_cols || n_pad - n_cols >= 16 || n_pad > 2048 || zx < 0 || zx > 255 || zo < 0 ||
        zo > 255) {
        PyErr_SetString(PyExc_ValueError, "patches_u8: bad shape, packing or zero point");
        return NULL;
    }
#ifdef HAVE_VNNI_PATCHES
    if (isa_cap < ISA_VNNI || !__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw"))
        Py_RETURN_FALSE;
    int64_t offsets[2048];
    for (int64_t a = 0; a < patch[0]; a++)
        for (int64_t b = 0; b < patch[1]; b++)
            offsets[a * patch[1] + b] = a * os[1] + b * os[2];
    const PatchArgs p = {(const int8_t *)(uintptr_t)w_addr, (const int32_t *)(uintptr_t)colsum_addr,
                         (const float *)(uintptr_t)bias_addr, k, n_pad, cout, cout % 16 == 0, (float)rcp,
                         (float)mult, (int)zx, (int)zo, offsets};
    const uint8_t *x = (const uint8_t *)(uintptr_t)x_addr;
    uint8_t *out = (uint8_t *)(uintptr_t)out_addr;
    const int64_t rows = dims[0] * dims[1] * dims[2];
    /* AMX for the whole 32-row blocks where the rows lie at one stride, VNNI for the rest */
    const int uniform = xs[1] == xs[2] * dims[2] && (dims[0] < 2 || xs[0] == xs[1] * dims[1]);
    const int64_t tiled = amx_usable() && uniform && p.direct && k % 4 == 0 ? rows / 32 * 32 : 0;
    Py_BEGIN_ALLOW_THREADS
    if (tiled)
        patches_amx(&p, x, xs[2], tiled, dims, out, os, patch);
    patches_vnni(&p, x, dims, xs, out, os, patch, tiled);
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
#else
    (void)x_addr; (void)w_addr; (void)colsum_addr; (void)bias_addr; (void)out_addr; (void)rcp; (void)mult;
    Py_RETURN_FALSE;
#endif
}

/* conv_u8: a conv (1, 2 or 3-d; groups 1, dilation 1) on AMX tiles, computing what fbgemm's (or qnnpack's) quantized
 * conv computes (tests/kernels/test_conv_native.py compares them bit for bit): exact int32 sums of u8*s8 products,
 * minus the input zero point times each output channel's weight sum, then the engine's per-channel requantization -
 * fbgemm: (float(acc) + bias / (s_x * s_w)) * multiplier; qnnpack: float(acc + int32 bias) * multiplier - rounded to
 * nearest even, saturated to int16, plus the output zero point, saturated to [0, 255] ([zo, 255] with a ReLU).
 * fbgemm builds an im2col copy per call and runs few-channel convs slowly (3->16 3x3 on 64x64 at batch 8: 1.8 ms,
 * 8 GMAC/s, here); this runs them as an implicit GEMM: the input is copied once into a buffer padded with its zero
 * point, where one kernel row's inputs for one output position - kw * C bytes - lie together, so each 16x16 int32
 * tile of output positions x channels sums kernel row by kernel row, up to 64 bytes at a time. Every shape is
 * (N, D, H, W, C): a 2-d conv has depth 1, a 1-d conv height 1 too. Weights: (kd * kh * ceil(kw * C / 4), n_pad, 4)
 * int8, four consecutive (kernel column, channel) inputs of one output channel together, zero beyond each kernel row
 * and beyond C_out; n_pad a multiple of 16. */
#ifdef HAVE_AMX_PATCHES
typedef struct {
    const int8_t *w;
    const int32_t *colsum;
    const int32_t *ibias; /* qnnpack: the bias rounded to int32 steps of s_x * s_w, added to the sums; else 0 */
    const float *bias;  /* fbgemm: bias / (s_x * s_w), per output channel, as fbgemm divides it; else 0 */
    const float *mult;  /* s_x * s_w / s_out (qnnpack: s_w * s_x * (1 / s_out)) */
    int64_t cp, n_pad, cout, kernel[3], stride[3];
    int zx, zo, relu;
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
    return _mm512_cvtusepi32_epi8(_mm512_max_epi32(sum, _mm512_set1_epi32(p->relu ? p->zo : 0)));
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
 * output channels: (ceil(n_pad / 64), ceil(C / 4), 64, 4) int8, so one block's bytes are read in order (the tiles'
 * layout puts consecutive groups of four inputs n_pad * 4 bytes apart: measured 1.2x slower than fbgemm on a cold
 * 1024 -> 1024 Linear on 8 rows, 0.9x with this). */
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
#endif

/* linear_rows_u8(x, rows, x row stride, C, w, colsum, int bias, bias, mult, n_pad, C_out, zx, zo, relu, out, out row
 * stride): a Linear on rows of bytes with the conv loop's requantization and its weights blocked by 64 channels,
 * by AVX512-VNNI (few rows, where 16-row AMX tiles would be mostly empty). Returns False (nothing written) without
 * VNNI. */
static PyObject *linear_rows_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, colsum_addr, ibias_addr, bias_addr, mult_addr, out_addr;
    int64_t rows, xs, c, n_pad, cout, zx, zo, os;
    int relu;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLLKKKKKLLLLpKL", &x_addr, &rows, &xs, &c, &w_addr, &colsum_addr, &ibias_addr,
                          &bias_addr, &mult_addr, &n_pad, &cout, &zx, &zo, &relu, &out_addr, &os))
        return NULL;
    if (rows < 0 || c < 1 || n_pad % 16 || n_pad < cout || cout < 1 || zx < 0 || zx > 255 || zo < 0 || zo > 255) {
        PyErr_SetString(PyExc_ValueError, "linear_rows_u8: bad shape, packing or zero point");
        return NULL;
    }
#ifdef HAVE_AMX_PATCHES
    if (isa_cap < ISA_VNNI || !__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw"))
        Py_RETURN_FALSE;
    const ConvArgs p = {(const int8_t *)(uintptr_t)w_addr, (const int32_t *)(uintptr_t)colsum_addr,
                        (const int32_t *)(uintptr_t)ibias_addr, (const float *)(uintptr_t)bias_addr,
                        (const float *)(uintptr_t)mult_addr, c, n_pad, cout, {1, 1, 1}, {1, 1, 1}, (int)zx, (int)zo,
                        relu};
    Py_BEGIN_ALLOW_THREADS
    rows_vnni(&p, (const uint8_t *)(uintptr_t)x_addr, rows, xs, (uint8_t *)(uintptr_t)out_addr, os);
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
#else
    (void)x_addr; (void)w_addr; (void)colsum_addr; (void)ibias_addr; (void)bias_addr; (void)mult_addr;
    (void)out_addr; (void)relu; (void)rows; (void)xs; (void)os;
    Py_RETURN_FALSE;
#endif
}

/* conv_u8(x, (N, D, H, W, C), x strides, kernel, stride, padding, w, colsum, bias, mult, C_pad, n_pad, C_out, zx, zo,
 * relu, out, (Do, Ho, Wo), out strides): triples over (depth, height, width); strides of the (N, D, H, W)
 * dimensions in bytes, channels at stride 1. Returns False (nothing written) where AMX is not usable; the caller
 * keeps fbgemm's conv. */
static PyObject *conv_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, colsum_addr, ibias_addr, bias_addr, mult_addr, out_addr;
    int64_t dims[5], xs[4], kernel[3], stride[3], pads[3], cp, n_pad, cout, zx, zo, odims[3], os[4];
    int relu;
    (void)self;
    if (!PyArg_ParseTuple(args, "K(LLLLL)(LLLL)(LLL)(LLL)(LLL)KKKKKLLLLLpK(LLL)(LLLL)", &x_addr, &dims[0], &dims[1],
                          &dims[2], &dims[3], &dims[4], &xs[0], &xs[1], &xs[2], &xs[3], &kernel[0], &kernel[1],
                          &kernel[2], &stride[0], &stride[1], &stride[2], &pads[0], &pads[1], &pads[2], &w_addr,
                          &colsum_addr, &ibias_addr, &bias_addr, &mult_addr, &cp, &n_pad, &cout, &zx, &zo, &relu,
                          &out_addr, &odims[0], &odims[1], &odims[2], &os[0], &os[1], &os[2], &os[3]))
        return NULL;
    int bad = dims[0] < 0 || dims[4] < 1 || cp != dims[4] || n_pad % 16 || n_pad < cout || cout < 1 ||
              zx < 0 || zx > 255 || zo < 0 || zo > 255;
    for (int i = 0; i < 3; i++)
        bad |= dims[i + 1] < 1 || kernel[i] < 1 || stride[i] < 1 || pads[i] < 0 || odims[i] < 1 ||
               odims[i] != (dims[i + 1] + 2 * pads[i] - kernel[i]) / stride[i] + 1;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "conv_u8: bad shape, packing or zero point");
        return NULL;
    }
#ifdef HAVE_AMX_PATCHES
    if (!amx_usable())
        Py_RETURN_FALSE;
    const int64_t pdims[4] = {dims[0], dims[1] + 2 * pads[0], dims[2] + 2 * pads[1], dims[3] + 2 * pads[2]};
    const size_t used = (size_t)(pdims[0] * pdims[1] * pdims[2] * pdims[3] * cp);
    /* tiles of a row's last positions read up to 16 strides and a kernel row (rounded up) past it: slack after */
    const size_t size = used + (size_t)((16 * stride[2] + kernel[2]) * cp + 64);
    uint8_t *pad = malloc(size);
    if (pad == NULL)
        return PyErr_NoMemory();
    const ConvArgs p = {(const int8_t *)(uintptr_t)w_addr, (const int32_t *)(uintptr_t)colsum_addr,
                        (const int32_t *)(uintptr_t)ibias_addr, (const float *)(uintptr_t)bias_addr,
                        (const float *)(uintptr_t)mult_addr, cp, n_pad, cout,
                        {kernel[0], kernel[1], kernel[2]}, {stride[0], stride[1], stride[2]}, (int)zx, (int)zo,
                        relu};
    Py_BEGIN_ALLOW_THREADS
    conv_pad((const uint8_t *)(uintptr_t)x_addr, dims, xs, pads, cp, (int)zx, pad);
    memset(pad + used, (int)zx, size - used);
    conv_amx(&p, pad, pdims, odims, (uint8_t *)(uintptr_t)out_addr, os);
    Py_END_ALLOW_THREADS
    free(pad);
    Py_RETURN_TRUE;
#else
    (void)x_addr; (void)w_addr; (void)colsum_addr; (void)ibias_addr; (void)bias_addr; (void)mult_addr;
    (void)out_addr; (void)relu;
    Py_RETURN_FALSE;
#endif
}

/* copy_rows(src, src_stride, dst, dst_stride, rows, width): ``rows`` rows of ``width`` bytes. A channel concat of
 * channels-last activations is one such copy per input (rows: the pixels, width: its channels); torch's cat on
 * quantized tensors takes 3-8x longer at U-Net shapes. With AVX512-BW one masked 64-byte move per row up to 64
 * bytes, 64-byte steps beyond. */
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

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    unsigned long long src_addr, dst_addr;
    int64_t ss, ds, rows, width;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLKLLL", &src_addr, &ss, &dst_addr, &ds, &rows, &width))
        return NULL;
    if (rows < 0 || width < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: negative size");
        return NULL;
    }
    const uint8_t *src = (const uint8_t *)(uintptr_t)src_addr;
    uint8_t *dst = (uint8_t *)(uintptr_t)dst_addr;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX512_COPY
    if (isa_cap >= ISA_AVX512 && __builtin_cpu_supports("avx512bw"))
        copy_rows_avx512(src, ss, dst, ds, rows, width);
    else
#endif
        for (int64_t r = 0; r < rows; r++)
            memcpy(dst + r * ds, src + r * ss, (size_t)width);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_isa_cap", set_isa_cap, METH_VARARGS, "Cap the instruction sets the loops use (FXQUANT_ISA)."},
    {"scan_f32", scan_f32, METH_VARARGS, "Min, max and grid counts of dense float32 values in one read."},
    {"quantize_f32", quantize_f32, METH_VARARGS, "float32 -> uint8/int8 with one scale and zero point (NCHW->NHWC)."},
    {"mean_u8", mean_u8, METH_VARARGS, "Rounded per-channel means of uint8 activations (global average pool)."},
    {"mul_u8", mul_u8, METH_VARARGS, "Product of two uint8 activations (b may broadcast), rounded once."},
    {"lookup_u8", lookup_u8, METH_VARARGS, "dst[i] = table[src[i]] over n bytes (a 256-entry table)."},
    {"conv_u8", conv_u8, METH_VARARGS, "A conv as fbgemm or qnnpack computes it, on AMX tiles."},
    {"linear_rows_u8", linear_rows_u8, METH_VARARGS, "A Linear on a few rows as fbgemm or qnnpack computes it."},
    {"copy_rows", copy_rows, METH_VARARGS, "Copy rows of bytes between two strided 2-d layouts."},
    {"patches_u8", patches_u8, METH_VARARGS, "A kernel == stride transposed conv as fbgemm's Linear, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fxquant.native._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
