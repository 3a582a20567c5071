/* linear_rows_u8_avx2: a Linear on a few rows as fbgemm computes it, on AVX2 alone - the few-row loop of CPUs without
 * VNNI (amx_gemm.c has the VNNI one), where fbgemm's own kernel reads each weight byte for a single row through
 * its general GEMM. linear_rows_onednn_avx2: the same sums with oneDNN's requantization, for the onednn backend's
 * few-row Linears on such CPUs, where oneDNN's matmul primitive takes 1.05-2.1x the loop's time on 1 to 32 rows
 * (docs/backends.md).
 *
 * vpmaddubsw sums each pair of u8*s8 products (inputs 2j, 2j + 1) in 16 bits, saturating, and vpmaddwd against ones
 * sums those pairs in 32 bits: exact where the inputs are 7-bit (2 * 127 * 128 < 32767), as fxquant's fbgemm qparams
 * are on such CPUs; fbgemm's AVX2 kernel pairs the same inputs with the same instructions, so on 8-bit inputs both
 * saturate alike (tests/kernels/test_conv_native.py). Weights: the VNNI loop's layout, blocked by 64 output channels,
 * (ceil(n_pad / 64), ceil(C / 4), 64, 4) int8, eight channels x four inputs per 32 bytes. One row against one block
 * sums in eight accumulators (of AVX2's sixteen registers), the block's bytes read in order: tiles of several rows
 * x fewer channels read the block in strides, which measured slower once other layers had evicted it from the
 * caches (docs/amx.md). The requantization is the VNNI loop's (conv_requantize), on eight channels, or oneDNN's
 * (OnednnRequant). Arguments arrive checked (module.c), which asks fxq_avx2_usable first; runs without the
 * GIL.
 */
#include <stdint.h>
#include <string.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "onednn_requant.h"

#define GROUPS 8      /* of eight output channels: a 64-channel block */
#define PREFETCH 768 /* bytes ahead: three steps of four inputs (512-2048 measured alike) */

/* the VNNI loop's requantization of eight channels' sums at col, saturated to [relu ? zo : 0, qmax]; n stored */
__attribute__((target("avx2"), always_inline)) static inline void requantize8(
    const GemmWeights *w, const Requant *r, const __m256i acc, const int64_t col, uint8_t *dst, const int64_t n) {
    const __m256i offset = _mm256_mullo_epi32(_mm256_set1_epi32((int)r->zx),
                                              _mm256_loadu_si256((const __m256i *)(w->colsum + col)));
    const __m256i sums = _mm256_add_epi32(_mm256_sub_epi32(acc, offset),
                                          _mm256_loadu_si256((const __m256i *)(w->ibias + col)));
    const __m256 f = _mm256_add_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(w->bias + col));
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(f, _mm256_loadu_ps(w->mult + col)));
    const __m256i sum = _mm256_add_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(32767)), _mm256_set1_epi32((int)r->zo));
    const __m256i low = _mm256_set1_epi32(r->relu ? (int)r->zo : 0);
    const __m256i bytes = _mm256_min_epi32(_mm256_max_epi32(sum, low), _mm256_set1_epi32((int)r->qmax));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
    const __m128i packed = _mm_packus_epi16(words, words);
    if (n >= 8) {
        _mm_storel_epi64((__m128i *)dst, packed);
    } else {
        uint8_t tail[16];
        _mm_storeu_si128((__m128i *)tail, packed);
        memcpy(dst, tail, (size_t)n);
    }
}

/* oneDNN's requantization (OnednnRequant) of eight channels' sums at col: n outputs stored, bytes or float32 */
__attribute__((target("avx2"), always_inline)) static inline void onednn8(
    const GemmWeights *w, const OnednnRequant *r, const __m256i acc, const int64_t col, uint8_t *dst, const int64_t n) {
    const __m256i offset = _mm256_mullo_epi32(_mm256_set1_epi32((int)r->zx),
                                              _mm256_loadu_si256((const __m256i *)(w->colsum + col)));
    fxq_onednn_store8(_mm256_sub_epi32(acc, offset), w->mult + col, w->bias + col, r, NULL, dst, n);
}

/* One row's sums against one block of 64 output channels from col0: eight groups of eight in eight accumulators,
 * the block's 256 bytes per four inputs read in order. `first`: the block's first row, whose weights come from
 * memory: it prefetches PREFETCH bytes ahead, which keeps more lines in flight than the hardware's prefetcher does
 * alone (docs/backends.md, "Few-row Linears on CPUs with AVX2 alone"); the next rows find the block in L2 */
__attribute__((target("avx2"), always_inline)) static inline void block_sums(const GemmWeights *w, const uint8_t *x,
                                                                             const int64_t col0, const int first,
                                                                             __m256i acc[GROUPS]) {
    const int64_t k = w->in_channels, full = k / 4, tail = k % 4;
    const int8_t *wt = w->w + (col0 / 64) * ((k + 3) / 4) * 256;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < GROUPS; g++)
        acc[g] = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < full + (tail != 0); kk++) {
        int32_t four = 0;
        if (kk < full)
            memcpy(&four, x + 4 * kk, 4);
        else
            for (int64_t j = 0; j < tail; j++)
                four |= (int32_t)x[4 * kk + j] << (8 * j);
        const __m256i a = _mm256_set1_epi32(four);
        if (first) /* (past the weights' end a prefetch is dropped: it never faults) */
            for (int line = 0; line < 4; line++)
                _mm_prefetch((const char *)(wt + kk * 256 + PREFETCH + 64 * line), _MM_HINT_T0);
        for (int g = 0; g < GROUPS; g++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(wt + kk * 256 + 32 * g));
            acc[g] = _mm256_add_epi32(acc[g], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
        }
    }
}

/* The 64-channel blocks split over torch's threads (each output is one thread's, summed in one order: the bytes do
 * not depend on the thread count), each row in turn against a block: its weights stream from memory in order for
 * the first row and stay in L2 for the next. Groups past C_out summed zeros and are not stored. Inlined into each
 * caller with `onednn` a constant, so the accumulators stay in registers (through a function pointer per group
 * they went to the stack: 10-14% slower on 16 and 32 rows). */
__attribute__((target("avx2"), always_inline)) static inline void rows_loop(const ByteRows *x, int64_t rows,
                                                                           const GemmWeights *w, const int onednn,
                                                                           const void *r, const ByteRows *out) {
    const int64_t blocks = (w->n_pad + 63) / 64;
    const int64_t size = onednn && ((const OnednnRequant *)r)->float_out ? (int64_t)sizeof(float) : 1;
    FXQ_PARALLEL_FOR(w->n_pad * w->in_channels >= FXQ_PARALLEL_WORK)
    for (int64_t block = 0; block < blocks; block++)
        for (int64_t row = 0; row < rows; row++) {
            __m256i acc[GROUPS];
            block_sums(w, x->data + row * x->stride, 64 * block, row == 0, acc);
            uint8_t *dst = out->data + row * out->stride;
            for (int64_t g = 0, col = 64 * block; g < GROUPS && col < w->out_channels; g++, col += 8) {
                if (onednn)
                    onednn8(w, (const OnednnRequant *)r, acc[g], col, dst + col * size, w->out_channels - col);
                else
                    requantize8(w, (const Requant *)r, acc[g], col, dst + col, w->out_channels - col);
            }
        }
}

__attribute__((target("avx2"))) void fxq_linear_rows_u8_avx2(const ByteRows *x, int64_t rows, const GemmWeights *w,
                                                              const Requant *r, const ByteRows *out) {
    rows_loop(x, rows, w, 0, r, out);
}

__attribute__((target("avx2"))) void fxq_linear_rows_onednn_avx2(const ByteRows *x, int64_t rows, const GemmWeights *w,
                                                                  const OnednnRequant *r, const ByteRows *out) {
    rows_loop(x, rows, w, 1, r, out);
}

int fxq_avx2_usable(void) { return __builtin_cpu_supports("avx2"); }

#else /* no x86-64 GNU C: module.c asks fxq_avx2_usable first and never calls the kernel */

void fxq_linear_rows_u8_avx2(const ByteRows *x, int64_t rows, const GemmWeights *w, const Requant *r,
                             const ByteRows *out) {
    (void)x; (void)rows; (void)w; (void)r; (void)out;
}

void fxq_linear_rows_onednn_avx2(const ByteRows *x, int64_t rows, const GemmWeights *w, const OnednnRequant *r,
                                 const ByteRows *out) {
    (void)x; (void)rows; (void)w; (void)r; (void)out;
}

int fxq_avx2_usable(void) { return 0; }

#endif
